"""Reference models that know how to be parallelised: ``from jupyter_dist.models import Transformer``.

Importing this package imports torch. The models carry their own tensor-parallel layout (``tp_plan``), so
``jd.wrap`` can apply ``fsdp2+tp2+sp`` to them without a plan from the user; they are also the subjects of the
equal-math tests (a parallel run's losses and parameters equal a single-process run's).
"""

from .transformer import Transformer, TransformerConfig

__all__ = ["Transformer", "TransformerConfig"]

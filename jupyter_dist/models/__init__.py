"""Reference models that know how to be parallelised: ``Transformer`` and ``MoETransformer``.

``from jupyter_dist.models import Transformer`` (dense, Llama-style) or ``MoETransformer`` (its mixture-of-experts
variant, for expert parallelism).
Importing this package imports torch. The models carry their own tensor-parallel layout (``tp_plan``), so
``jd.wrap`` can apply ``fsdp2+tp2+sp`` to them without a plan from the user; they are also the subjects of the
equal-math tests (a parallel run's losses and parameters equal a single-process run's).
"""

from .moe import MoETransformer, MoETransformerConfig
from .transformer import Transformer, TransformerConfig

__all__ = ["MoETransformer", "MoETransformerConfig", "Transformer", "TransformerConfig"]

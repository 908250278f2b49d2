"""Diagnose communication failures from rank logs (stdlib only): classify, find the first failing rank, say the fix.

A failed distributed job leaves one log per rank, and most of those logs are noise: when one rank dies, every
other rank reports *that* ("Connection closed by peer", "ncclRemoteError", a watchdog timeout ten minutes later).
This package reads the real message formats of PyTorch (c10d, ProcessGroupNCCL, ProcessGroupGloo, TCPStore,
torchrun) and of NCCL itself, and answers three questions:

* what went wrong on each rank -- :func:`classify` turns a log into :class:`Finding` objects, each with a stable
  ``kind``, the evidence lines, a concrete ``fix`` and whether it is a root cause or a consequence (``primary``);
* which rank failed first -- :func:`diagnose_ranks` picks it (earliest exit, else the rank with a root cause, else
  the rank a timeout report names) and orders the findings so that the cause comes before the cascade;
* what NCCL set up -- :func:`parse_nccl_line` reads NCCL's debug line format and :func:`nccl_facts` summarises
  the init lines (version, network, transports, ranks, nodes, warnings) as :class:`NcclFacts`.

Three rooms: :mod:`.patterns` is the table (every kind with its fix, every rule with the source that emits the
message and its format string), :mod:`.engine` applies it (:func:`classify`, :func:`diagnose_ranks`,
:class:`Diagnosis`), :mod:`.nccl` parses NCCL's debug lines. A new failure message is a rule in :mod:`.patterns`
and a golden log in ``tests/test_diagnose.py``; the engine does not change.
"""

from __future__ import annotations

from .engine import Diagnosis, Finding, classify, diagnose_ranks, parse_child_failures, split_by_rank
from .nccl import NcclFacts, NcclLine, nccl_facts, parse_nccl_line
from .patterns import KINDS

__all__ = [
    "KINDS",
    "NcclLine",
    "NcclFacts",
    "Finding",
    "Diagnosis",
    "parse_nccl_line",
    "nccl_facts",
    "classify",
    "diagnose_ranks",
    "split_by_rank",
    "parse_child_failures",
]

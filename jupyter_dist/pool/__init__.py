"""The interactive pool: ranks that live from cell to cell (``%dist_start``, ``%%dist``).

* :mod:`.kernel` — the kernel side, :class:`~.kernel.Pool`: starts the ranks through the local launcher, sends cells,
  gathers outputs, stops;
* :mod:`.rank` — the rank side: the loop each torchrun process runs (execute a cell in a persistent namespace);
* :mod:`.results` — what the pool returns and raises (``CellResult``, ``RankReport``, ``CellError``...);
* :mod:`.channel` — the authenticated, length-prefixed control channel between them (127.0.0.1 only).

The magics that drive it are in :mod:`jupyter_dist.magics.pool`. See docs/architecture.md, "Layers".
"""

"""The package's version, alone in a module: ``jupyter_dist.cli`` prints it without importing the package root.

The root imports the magics, which import ``jupyter_dist.cli``, so the CLI importing the root would be a circle
(docs/architecture.md, "No import circles").
"""

__version__ = "0.1.0"

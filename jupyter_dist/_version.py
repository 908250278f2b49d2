"""The package's version, alone in a module: ``cli.py`` prints it without importing the package root.

The root imports the magics, which import ``cli.py``, so ``cli.py`` importing the root would be a circle
(docs/architecture.md, "No import circles").
"""

__version__ = "0.1.0"

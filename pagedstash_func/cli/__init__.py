"""The command line (``python -m pagedstash_func``): the demo, the stash demo and ``bench/``.

The library never imports this package; everything here uses public `pagedstash_func` names.
"""

from ._main import main

__all__ = ["main"]

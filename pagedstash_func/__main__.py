"""``python -m pagedstash_func``: the command line lives in `pagedstash_func.cli`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())

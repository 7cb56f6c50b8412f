"""Imported first by the package: imports geoopt without its import-time FutureWarning (see below)."""

import re
import warnings


def import_geoopt_quietly() -> None:
    """Import geoopt without its import-time ``torch.jit.script`` FutureWarning, leaving ``warnings.filters``
    as geoopt and torch themselves leave it.

    geoopt 0.5.1 calls ``torch.jit.script`` at import time, which torch >= 2.9 flags as deprecated; the
    warning is about geoopt's internals. One ``ignore`` entry is added for that import and then removed
    again. (``warnings.catch_warnings`` would instead restore the whole list and so drop the filters that
    torch, numpy and scipy install when they are first imported inside it.)
    """
    message = "`torch.jit.script` is deprecated"
    entry = ("ignore", re.compile(message, re.I), FutureWarning, None, 0)  # what filterwarnings inserts
    if entry in warnings.filters:  # the user's own filter: leave it where it is
        import geoopt  # noqa: F401
        return
    warnings.filterwarnings("ignore", message=message, category=FutureWarning)
    try:
        import geoopt  # noqa: F401
    finally:
        if entry in warnings.filters:
            warnings.filters.remove(entry)


import_geoopt_quietly()

"""Where this machine caches models: ``$PLIMSOLL_CACHE_DIR``, else ``~/.cache/plimsoll/models``.

What it is: the one rule shared by the runtime (the embedded model, converted once into it),
the local control plane's pod runner (replicas' model volumes map to it) and the image (which
sets ``PLIMSOLL_CACHE_DIR=/opt/plimsoll/models`` and converts the embedded model there at build).

What it is not: a cache manager (nothing is evicted) or the hub client's cache (``HF_HOME``).
"""

import os
from pathlib import Path


def model_cache_dir() -> Path:
    return Path(os.environ.get("PLIMSOLL_CACHE_DIR") or Path.home() / ".cache" / "plimsoll" / "models")

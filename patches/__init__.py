"""Data only: versioned patch files (``<package>/<version>/NNNN-name.patch``) and ``manifest.json``,
read by :mod:`sglang_ddtree.patcher`. See ``README.md`` here for how a patch is made."""

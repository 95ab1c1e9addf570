"""Build of the optional C extension ``ddiloco._kernels`` (fused outer-step kernels for the
syncer). Everything else is in pyproject.toml. Without a C compiler the build still succeeds
(``optional=True``) and ddiloco uses the equivalent torch operations."""

import sys

from setuptools import Extension, setup

args = [] if sys.platform == "win32" else ["-O3", "-ffp-contract=off"]
setup(ext_modules=[Extension("ddiloco._kernels", ["src/ddiloco/_kernels.c"],
                             extra_compile_args=args, optional=True)])

"""Packaging: ship csrc/ inside the package as zero/_csrc so installed copies can JIT-build ops.

An editable install reads csrc/ from the checkout directly (see zero/ops/builder.py).
"""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithSources(build_py):
    def run(self):
        super().run()
        dst = Path(self.build_lib) / "zero" / "_csrc"
        shutil.rmtree(dst, ignore_errors=True)
        # csrc/dev/ holds standalone programs for developers, not op sources
        shutil.copytree(ROOT / "csrc", dst, ignore=shutil.ignore_patterns("*.o", "*.so", "build*", "dev"))


setup(cmdclass={"build_py": BuildPyWithSources})

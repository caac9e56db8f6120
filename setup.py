"""Build hook (everything else is in pyproject.toml): the wheel carries the parity sweep's
record, docs/support.json, as ``fused_ce_patch/hf/support.json``, where
``fused_ce_patch.hf.verified`` reads it outside a source checkout. The file stays under docs/
in the repository (it is documentation that docs/support.md is generated from)."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

RECORD = Path(__file__).resolve().parent / "docs" / "support.json"


class BuildPyWithRecord(build_py):
    def run(self):
        super().run()
        if not RECORD.exists():  # an sdist without it (MANIFEST.in lists it) is a broken one
            raise FileNotFoundError(f"{RECORD}: the support record the wheel must carry")
        target = Path(self.build_lib) / "fused_ce_patch" / "hf" / "support.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(RECORD, target)


setup(cmdclass={"build_py": BuildPyWithRecord})

"""Print the oldest version of a package that setup.cfg claims to support, as MAJOR.MINOR.

    python .ci/claimed_version.py torch          # from install_requires: 'torch>=2.5'  -> 2.5
    python .ci/claimed_version.py transformers   # from the hf extra: 'transformers>=5.1,<6' -> 5.1

The CI legs that test the oldest claimed versions read them here, so raising a claim in setup.cfg moves the test.
"""
import configparser
import pathlib
import re
import sys

WHERE = {"torch": ("options", "install_requires"), "transformers": ("options.extras_require", "hf")}


def claimed(package: str) -> str:
    if package not in WHERE:
        raise SystemExit(f"claimed_version.py: package must be one of {sorted(WHERE)}, got {package!r}")
    section, key = WHERE[package]
    cfg = configparser.ConfigParser()
    cfg.read(pathlib.Path(__file__).resolve().parent.parent / "setup.cfg")
    found = re.search(rf"^\s*{package}\s*>=\s*(\d+\.\d+)\b", cfg[section][key], re.M)
    if not found:
        raise SystemExit(f"setup.cfg: [{section}] {key} must claim '{package}>=X.Y' for CI to test the oldest one")
    return found.group(1)


if __name__ == "__main__":
    print(claimed(sys.argv[1] if len(sys.argv) > 1 else ""))

"""Where the measured data sets live when the user names no folder.

The project reads Gavel's, Zeus's and the H100 zoo's data from a ``shared/data`` folder kept
beside the checkout, never from a copy in the repository. A path relative to the working
directory (``../shared/data``) only works from the checkout's root, so a user who runs
``gogh simulate --truth gavel`` from their own project folder got "file not found" for data
that was on the machine. The default is therefore looked for in two places: relative to the
working directory (what the docs always said, and what an explicit ``cd`` relies on), then
beside the checkout the package was installed from (an editable install:
``<checkout>/../shared/data``). An environment variable or an argument always wins.
"""

from __future__ import annotations

from pathlib import Path

#: the default, relative to the working directory
RELATIVE = Path("../shared/data")
#: the folder that holds the package: a checkout's root, or site-packages when installed
_ABOVE_PACKAGE = Path(__file__).resolve().parents[1]
#: the same folder beside the checkout this package was installed from (editable installs)
BESIDE_CHECKOUT = _ABOVE_PACKAGE.parent / "shared" / "data"


def shipped(name: str) -> Path:
    """The repository's top-level ``models/`` or ``blocks/``: the checkout's folder when this
    package runs from one, else the copy a wheel installs inside the package
    (``gogh_flows/shipped/<name>``, pyproject.toml's package-dir)."""
    checkout = _ABOVE_PACKAGE / name
    # a checkout only where its pyproject.toml is: installed, parents[1] is site-packages, where
    # another distribution's top-level models/ package took the place of the priors (a review)
    return checkout if _in_checkout() and checkout.is_dir() else Path(__file__).resolve().parent / "shipped" / name


def default_data(sub: str = "") -> Path:
    """``../shared/data/<sub>`` if it exists from the working directory, else the folder beside
    the checkout if that exists, else the relative path (so an error names where it looked)."""
    for root in (RELATIVE, BESIDE_CHECKOUT):
        if (root / sub).exists():
            return root / sub
    return RELATIVE / sub


def where_looked(sub: str = "") -> str:
    """The default's places, for error messages (beside the checkout only where the package runs
    from one: an installed wheel's would name a folder inside the environment)."""
    here = f"{RELATIVE / sub} from the working directory ({(RELATIVE / sub).resolve()})"
    if not _in_checkout():
        return here
    return f"{here}, then {BESIDE_CHECKOUT / sub} beside the checkout"


def _in_checkout() -> bool:
    return (_ABOVE_PACKAGE / "pyproject.toml").is_file()


__all__ = ["BESIDE_CHECKOUT", "RELATIVE", "default_data", "shipped", "where_looked"]

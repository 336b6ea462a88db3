"""``python -m lilicorr_pl`` is the ``lilicorr`` command."""

from lilicorr_pl.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

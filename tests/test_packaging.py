"""The wheel carries the configs (issue 12.6): built offline from a copy of the source, then used from elsewhere.

``pip wheel --no-deps --no-build-isolation --no-index`` needs nothing but the installed setuptools; the wheel is
unpacked (a wheel is a zip of the site-packages layout) and imported from a directory with no ``configs/`` in
sight, so everything found there comes from the package itself through ``importlib.resources``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ("pyproject.toml", "README.md", "lilicorr_pl", "callbacks", "configs")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools")
    src, dist = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in SOURCE:  # a copy: the build's own build/ and *.egg-info never land in the repository
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                          "-q", "-w", str(dist), str(src)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    (whl,) = dist.glob("lilicorr_pl-*.whl")
    return whl


def test_the_wheel_holds_every_shipped_config(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "configs").rglob("*")
                     if p.is_file() and p.suffix in (".yaml", ".json"))
    assert shipped and "configs/demo/base.yaml" in shipped and "configs/qwen3-8b/base.yaml" in shipped
    # perf's cost model reads Qwen3-8B's shapes from the config the README's command names (--target_config)
    assert "configs/qwen3-8b/Qwen3-8B.config.json" in shipped
    assert not [p for p in (ROOT / "configs").rglob("*") if p.is_file() and p.suffix not in (".yaml", ".json")]
    assert {f"configs/qwen3-8b/{arm}.yaml" for arm in ("dflash", "lilicorr", "domino", "dspark")} <= set(shipped)
    missing = [c for c in shipped if f"lilicorr_pl/{c}" not in names]
    assert not missing, f"configs missing from the wheel: {missing}"
    assert "callbacks/acceptance.py" in names and "lilicorr_pl/cli.py" in names


@pytest.mark.slow
def test_the_installed_package_resolves_the_demo_and_recipe_configs(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"  # no configs/ here
    elsewhere.mkdir()
    probe = (
        "import json, lilicorr_pl\n"
        "from lilicorr_pl.command import shipped_configs, shipped_config_path\n"
        "from lilicorr_pl.demo.run import ARMS, BASE_CONFIG, CONFIG_DIR\n"
        "overlays = sorted({o for arm in ARMS.values() for o in arm.overlays})\n"
        "print(json.dumps({'package': lilicorr_pl.__file__, 'root': str(shipped_configs()),\n"
        "  'demo': [str(CONFIG_DIR / c) for c in [BASE_CONFIG, *overlays]],\n"
        "  'recipe': [shipped_config_path(f'configs/qwen3-8b/{c}.yaml') for c in ('base', 'lilicorr')]}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site), "WANDB_MODE": "disabled"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(found["package"]).is_relative_to(site)  # the unpacked wheel, not this checkout
    assert Path(found["root"]).is_relative_to(site)
    for path in [*found["demo"], *found["recipe"]]:
        assert Path(path).is_relative_to(site) and Path(path).is_file(), path
    # `lilicorr fit -c configs/<recipe>` from a directory without configs/: parsed from the packaged file.
    out = subprocess.run([sys.executable, "-m", "lilicorr_pl", "fit", "-c", "configs/qwen3-8b/base.yaml",
                          "-c", "configs/qwen3-8b/lilicorr.yaml", "--print_config"],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "Qwen/Qwen3-8B" in out.stdout and "LiLiCorrHead" in out.stdout
    # The README's cost-model command, from there: Qwen3-8B's config.json is found in the package too.
    out = subprocess.run([sys.executable, "-m", "lilicorr_pl", "perf", "--cost_model", "true", "-c",
                          "configs/qwen3-8b/base.yaml", "-c", "configs/qwen3-8b/lilicorr.yaml", "--target_config",
                          "configs/qwen3-8b/Qwen3-8B.config.json", "--context", "2048", "--gpu", "h100"],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "36 layers" in out.stdout and "head share of the round" in out.stdout

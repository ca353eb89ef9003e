"""``SLUICE_MOONCAKE_COMPAT=1`` makes an unchanged program's ``import mooncake.engine`` give
the Sluice facade; ``install()`` does the same from code. Each case runs in a fresh
interpreter, since the hook acts at start-up (the .pth file the wheel puts in site-packages).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import sluice

PTH = "sluice-mooncake-compat.pth"


def run(code: str, compat=None, timeout=120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("SLUICE_MOONCAKE_COMPAT", None)
    if compat is not None:
        env["SLUICE_MOONCAKE_COMPAT"] = compat
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_pth_file_is_installed_beside_the_package():
    site_dir = os.path.dirname(os.path.dirname(os.path.abspath(sluice.__file__)))
    assert os.path.isfile(os.path.join(site_dir, PTH)), f"{PTH} missing from {site_dir}"


def test_env_var_redirects_import_mooncake_engine():
    r = run("""
        from mooncake.engine import TransferEngine, TransferOpcode, TransferNotify
        import mooncake.engine, sluice.compat.mooncake as facade
        assert TransferEngine is facade.TransferEngine, TransferEngine
        assert mooncake.engine.__sluice_compat__
        te = TransferEngine()
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
        assert te.get_rpc_port() > 0
        print("facade")
        """, compat="1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "facade"


def test_without_the_env_var_nothing_changes():
    r = run("""
        import sys
        try:
            import mooncake.engine as m
        except ImportError:
            print("no mooncake")
        else:
            print("facade" if getattr(m, "__sluice_compat__", False) else "mooncake")
        assert "sluice" not in sys.modules  # the .pth line imports nothing then
        """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() in ("no mooncake", "mooncake")


def test_a_bad_value_is_reported_and_leaves_the_hook_off():
    r = run("import sys; from sluice.compat import _hook; sys.exit(1 if _hook.active() else 0)", compat="maybe")
    assert r.returncode == 0
    assert "SLUICE_MOONCAKE_COMPAT='maybe' is not 1/0" in r.stderr


def test_stand_in_parent_when_mooncake_is_not_installed():
    # Hide site-packages (where Mooncake's wheel may be) after start-up: the hook then
    # provides an empty 'mooncake' package that holds only 'engine'.
    r = run("""
        import sys
        sys.path[:] = [p for p in sys.path if "site-packages" not in p and "dist-packages" not in p]
        import mooncake.engine, mooncake
        assert mooncake.__spec__.origin == "sluice-compat", mooncake.__spec__
        assert mooncake.engine.__sluice_compat__
        try:
            import mooncake.store
        except ImportError:
            print("ok")
        """, compat="1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_install_and_uninstall_from_code():
    r = run("""
        import sluice.compat.mooncake as facade
        facade.install()
        import mooncake.engine
        assert mooncake.engine.TransferEngine is facade.TransferEngine
        facade.uninstall()
        import sys
        assert "mooncake.engine" not in sys.modules
        try:
            import mooncake.engine as again
        except ImportError:
            print("gone")
        else:
            print("gone" if not getattr(again, "__sluice_compat__", False) else "still")
        """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "gone"

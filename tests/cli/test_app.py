from typer.testing import CliRunner

from ft import __version__
from ft.cli.app import app
from tests.conftest import run_ft


def test_version():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert __version__ in result.output


def test_unknown_option_is_one_line_error_exit_1():
    proc = run_ft("env", "--bogus")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == ["error: No such option: --bogus"]
    assert "Traceback" not in proc.stderr


def test_env_json():
    import json

    proc = run_ft("env", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["ft"] == __version__

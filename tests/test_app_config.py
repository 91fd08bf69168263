"""app.py's command line: the warm-up switch and which replicas it applies to, upload limits, engine flags, and the
users of `--auth` (repeated) and `--auth-file`, a malformed one refused naming the flag (no app is started here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import app
from h3engine.engine.options import EngineOptions


def test_replicas_warm_up_unless_told_not_to() -> None:
    assert app.parse_config([], {}).warm_up is True
    assert app.parse_config(["--no-warm-up"], {}).warm_up is False


def test_only_replicas_on_a_gpu_count_as_computing_on_cuda() -> None:
    assert app._computes_on_cuda(SimpleNamespace(device=torch.device("cuda", 1)))
    assert not app._computes_on_cuda(SimpleNamespace(device=torch.device("cpu")))
    assert app._computes_on_cuda(SimpleNamespace(spec=SimpleNamespace(devices=("cuda:0", "cuda:1"))))
    assert not app._computes_on_cuda(SimpleNamespace(spec=SimpleNamespace(devices=("cpu", "cpu"))))


def test_upload_limits_count_like_gradio_and_a_bad_one_names_the_option() -> None:
    assert app.parse_config([], {}).max_file_size == 200 * 1024**2
    assert app.parse_config(["--max-file-size", "3 KB"], {}).max_file_size == 3 * 1024
    for bad in ("lots", "200", "0mb", "1.5gb"):
        with pytest.raises(app.ConfigError, match="^--max-file-size: "):
            app.parse_config(["--max-file-size", bad], {})
    with pytest.raises(app.ConfigError, match="^--port: invalid int value: 'x'"):
        app.parse_config([], {"H3_PORT": "x"})


def test_engine_flags_are_the_clis_and_read_into_engine_options() -> None:
    config = app.parse_config(["--dit-sp", "2", "--dtype", "float32", "--memory-profile", "low-memory"], {})
    assert config.engine == EngineOptions(dit_sp=2, dtype="float32", memory_profile="low-memory")
    assert app.parse_config([], {"H3_MEMORY_PROFILE": "low-memory"}).engine.memory_profile == "low-memory"
    assert app.parse_config(["--fp8-linear"], {}).engine.fp8_linear is True


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        # The engine's own refusals, named by their flag (a ConfigError has no field but its text's prefix; the
        # sentences: tests/test_cli_hardening.py, tests/test_split_stages.py). Two rules on --fp8-linear: a
        # fragment tells which.
        (["--devices", "cpu", "--fp8-linear"], "^--fp8-linear: .*CUDA GPU"),
        (["--devices", "cpu", "--world-size", "2", "--fp8-linear"], "^--fp8-linear: .*one GPU only"),
        (["--world-size", "1", "--dit-sp", "2"], "^--dit-sp 2 "),
        (["--dtype", "half"], "^--dtype: "),
        (["--devices", "mps"], "^--devices: "),
    ],
    ids=["fp8-on-cpu", "fp8-in-a-group", "layout", "dtype", "device"],
)
def test_engine_options_are_checked_before_loading(tmp_path, arguments: list[str], message: str) -> None:
    config = app.parse_config([*arguments, "--outputs", str(tmp_path)], {})
    with pytest.raises(app.ConfigError, match=message):
        app.check_before_loading(config)


def test_auth_takes_several_users_from_repeated_flags_and_a_file(tmp_path) -> None:
    assert app.parse_config([], {}).auth == ()
    users = tmp_path / "users.txt"
    users.write_text("# the team\ncarol:c,with:colon and comma\n\n  dave:d4  \n", encoding="utf-8")
    config = app.parse_config(["--auth", "alice:a1", "--auth", "bob:b:2", "--auth-file", str(users)], {})
    assert config.auth == (
        ("alice", "a1"),
        ("bob", "b:2"),
        ("carol", "c,with:colon and comma"),
        ("dave", "d4"),
    )
    # The environment's pair when no flag gives one; H3_AUTH_FILE as --auth-file.
    assert app.parse_config([], {"H3_AUTH": "erin:e5"}).auth == (("erin", "e5"),)
    assert app.parse_config(["--auth", "alice:a1"], {"H3_AUTH": "erin:e5"}).auth == (("alice", "a1"),)
    assert app.parse_config([], {"H3_AUTH_FILE": str(users)}).auth == (
        ("carol", "c,with:colon and comma"),
        ("dave", "d4"),
    )


@pytest.mark.parametrize(
    ("arguments", "lines", "message"),
    [
        (["--auth", "nopassword"], None, "^--auth: expected USER:PASSWORD with neither empty$"),
        (["--auth", ":secret"], None, "^--auth: expected USER:PASSWORD"),
        (["--auth", "alice:"], None, "^--auth: expected USER:PASSWORD"),
        (
            ["--auth", "a:b,c:d"],
            None,
            "^--auth: one USER:PASSWORD per --auth, and no comma in it: repeat --auth",
        ),
        (["--auth", "alice:1", "--auth", "alice:2"], None, "^--auth: user 'alice' is named twice$"),
        (
            ["--auth", "alice:1"],
            "alice:2\n",
            r"^--auth-file: line 1 of .*users.txt: user 'alice' is named twice$",
        ),
        ([], "# no one\n\n", r"^--auth-file: .*users.txt names no user"),
        ([], "bob:2\nno colon here\n", r"^--auth-file: line 2 of .*users.txt: expected USER:PASSWORD"),
        ([], "bob:\n", r"^--auth-file: line 1 of .*users.txt: expected USER:PASSWORD"),
    ],
    ids=[
        "no-colon",
        "no-user",
        "no-password",
        "comma",
        "twice",
        "twice-in-file",
        "empty-file",
        "file-line",
        "file-empty-password",
    ],
)
def test_a_malformed_user_is_refused_naming_the_flag_but_no_password(
    tmp_path, arguments, lines, message
) -> None:
    users = tmp_path / "users.txt"
    if lines is not None:
        users.write_text(lines, encoding="utf-8")
        arguments = [*arguments, "--auth-file", str(users)]
    with pytest.raises(app.ConfigError, match=message) as refused:
        app.parse_config(arguments, {})
    assert "secret" not in str(refused.value)


def test_an_unreadable_auth_file_exits_2_with_one_line_naming_the_flag(tmp_path, capsys) -> None:
    assert app.main(["--auth-file", str(tmp_path / "missing.txt"), "--outputs", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"error: --auth-file: cannot read {tmp_path / 'missing.txt'} (No such file or directory)\n"
    )

"""Worker configuration: precedence, spellings, mock specs, secrets, bad values."""

from __future__ import annotations

import socket

import pytest

from rabit2.config import (
    DEFAULT_TREE_MINSIZE,
    Config,
    MockSpec,
    load_config,
    misspelled_env,
)
from rabit2.io.engine import Engine
from rabit2.io.handshake import resolve_congestion


def test_defaults_with_empty_environment() -> None:
    cfg = load_config(environ={})
    assert cfg == Config()
    assert cfg.tracker_uri is None and not cfg.distributed
    assert cfg.reduce_ring_mincount is None  # the byte threshold decides
    assert cfg.tree_reduce_minsize == DEFAULT_TREE_MINSIZE
    assert cfg.mock == () and cfg.secret == b""


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DMLC_TASK_ID", "from-os-environ")
    assert load_config().task_id == "from-os-environ"


def test_precedence_env_then_args_then_kwargs() -> None:
    env = {"DMLC_TRACKER_URI": "env-host", "DMLC_TASK_ID": "env-task", "DMLC_NUM_WORKER": "2"}
    args = ["dmlc_tracker_uri=arg-host", "rabit_task_id=arg-task"]
    kwargs = {"dmlc_tracker_uri": "kw-host"}
    assert load_config(environ=env).tracker_uri == "env-host"
    assert load_config(args, environ=env).tracker_uri == "arg-host"
    cfg = load_config(args, kwargs, environ=env)
    assert cfg.tracker_uri == "kw-host"  # kwargs beat args beat env
    assert cfg.task_id == "arg-task"  # args beat env
    assert cfg.world_size == 2  # env alone
    assert cfg.distributed


def test_later_args_win() -> None:
    cfg = load_config(["rabit_world_size=3", "dmlc_num_worker=5"], environ={})
    assert cfg.world_size == 5


@pytest.mark.parametrize(
    ("where", "key", "value", "field", "expected"),
    [
        ("env", "DMLC_TRACKER_URI", "10.0.0.1", "tracker_uri", "10.0.0.1"),
        ("env", "DMLC_TRACKER_PORT", "9099", "tracker_port", 9099),
        ("env", "DMLC_TASK_ID", "7", "task_id", "7"),
        ("env", "DMLC_NUM_ATTEMPT", "2", "num_attempt", 2),
        ("env", "DMLC_NUM_WORKER", "4", "world_size", 4),
        ("env", "DMLC_WORKER_CONNECT_RETRY", "9", "connect_retry", 9),
        ("env", "RABIT2_TIMEOUT_SEC", "12.5", "timeout_sec", 12.5),
        ("env", "RABIT2_CONNECT_TIMEOUT_SEC", "3", "connect_timeout_sec", 3.0),
        ("env", "RABIT2_HEARTBEAT_SEC", "0.25", "heartbeat_sec", 0.25),
        ("env", "RABIT2_LOOP", "asyncio", "loop", "asyncio"),
        ("env", "RABIT2_LOG_LEVEL", "debug", "log_level", "DEBUG"),
        ("arg", "rabit2_log_level", " Info ", "log_level", "INFO"),
        ("env", "RABIT2_SPIN_US", "0", "spin_us", 0),
        ("arg", "rabit2_spin_us", "50", "spin_us", 50),
        ("arg", "rabit_tracker_uri", "h", "tracker_uri", "h"),
        ("arg", "rabit_tracker_port", "1", "tracker_port", 1),
        ("arg", "dmlc_tracker_port", "2", "tracker_port", 2),
        ("arg", "rabit_num_trial", "3", "num_attempt", 3),
        ("arg", "dmlc_num_attempt", "4", "num_attempt", 4),
        ("arg", "rabit_world_size", "6", "world_size", 6),
        ("arg", "rabit_timeout_sec", "7", "timeout_sec", 7.0),
        ("arg", "dmlc_timeout", "8", "timeout_sec", 8.0),
        ("arg", "rabit2_timeout_sec", "9", "timeout_sec", 9.0),
        ("arg", "dmlc_retry", "2", "connect_retry", 2),
        ("arg", "rabit_reduce_ring_mincount", "0", "reduce_ring_mincount", 0),
        ("arg", "rabit_tree_reduce_minsize", "64", "tree_reduce_minsize", 64),
        ("arg", "rabit2_loop", "UVLOOP", "loop", "uvloop"),
        ("env", "RABIT2_TCP_CONGESTION", "Cubic", "tcp_congestion", "cubic"),
        ("arg", "rabit2_tcp_congestion", "system", "tcp_congestion", "system"),
        ("arg", "RABIT_TIMEOUT_SEC", "5", "timeout_sec", 5.0),  # keys are case-insensitive
        ("arg", "DMLC_TRACKER_URI", "upper", "tracker_uri", "upper"),
        ("kw", "world_size", "11", "world_size", 11),  # the field name itself, as a keyword
        ("kw", "dmlc_task_id", "kw", "task_id", "kw"),
        ("kw", "DMLC_NUM_WORKER", 3, "world_size", 3),
        ("kw", "timeout_sec", 2, "timeout_sec", 2.0),
        ("kw", "rabit2_connect_timeout_sec", 1.5, "connect_timeout_sec", 1.5),
        ("kw", "rabit2_heartbeat_sec", "2", "heartbeat_sec", 2.0),
        ("env", "RABIT2_LINK_TIMEOUT_SEC", "4.5", "link_timeout_sec", 4.5),
        ("arg", "rabit2_link_timeout_sec", "60", "link_timeout_sec", 60.0),
        ("env", "RABIT2_RING_MIN_BYTES", "2097152", "ring_min_bytes", 2097152),
        ("arg", "rabit2_ring_min_bytes", "0", "ring_min_bytes", 0),
    ],
)
def test_aliases(where: str, key: str, value: object, field: str, expected: object) -> None:
    if where == "env":
        cfg = load_config(environ={key: str(value)})
    elif where == "arg":
        cfg = load_config([f"{key}={value}"], environ={})
    else:
        cfg = load_config(kwargs={key: value}, environ={})
    assert getattr(cfg, field) == expected
    assert type(getattr(cfg, field)) is type(expected)


def test_env_reads_only_documented_upper_case_keys() -> None:
    # rabit-style lower-case spellings in the environment are not configuration
    cfg = load_config(environ={"rabit_world_size": "3", "DMLC_TRACKER_URI": "h"})
    assert cfg.world_size == -1 and cfg.tracker_uri == "h"


def test_args_accept_bytes_and_ignore_non_pairs() -> None:
    cfg = load_config(
        [b"rabit_task_id=bytes", "train.py", "--verbose", "=orphan", "nokey",
         " dmlc_num_worker = 4 "],
        environ={},
    )
    assert cfg.task_id == "bytes"
    assert cfg.world_size == 4


def test_unknown_plain_keys_are_ignored() -> None:
    assert load_config(["eta=0.1", "max_depth=6"], {"nthread": 4}, environ={}) == Config()


@pytest.mark.parametrize("arg", ["secret=hunter2", "task_id=foo", "loop=100",
                                 "log_level=verbose", "checksum=md5", "world_size=4",
                                 "recover=1", "timeout_sec=-3"])
def test_a_programs_own_arguments_named_like_fields_are_left_to_it(arg: str) -> None:
    """As rabit does: among k=v strings (the program's command line) only prefixed keys and
    rabit's mock= are read; a bare field name is a setting only as a keyword."""
    assert load_config([arg], environ={}) == Config()


def test_a_field_name_as_a_keyword_is_a_setting() -> None:
    cfg = load_config(kwargs={"timeout_sec": 60, "world_size": 4, "task_id": "foo"},
                      environ={})
    assert cfg.timeout_sec == 60 and cfg.world_size == 4 and cfg.task_id == "foo"
    with pytest.raises(ValueError, match="timeout_sec"):
        load_config(kwargs={"timeout_sec": -3}, environ={})


@pytest.mark.parametrize("key", ["rabit_foo", "dmlc_bar", "rabit2_baz", "RABIT_FOO"])
def test_unknown_prefixed_keys_raise(key: str) -> None:
    with pytest.raises(ValueError, match="unknown rabit2 parameter"):
        load_config([f"{key}=1"], environ={})
    with pytest.raises(ValueError, match="unknown rabit2 parameter"):
        load_config(kwargs={key: 1}, environ={})


@pytest.mark.parametrize(
    "key",
    ["rabit_enable_tcp_no_delay", "rabit_timeout", "rabit_reduce_buffer", "rabit_debug",
     "rabit_bootstrap_cache", "rabit_global_replica",
     "rabit_hadoop_mode", "dmlc_communicator", "xgboost_communicator", "dmlc_role",
     "dmlc_nccl_path", "dmlc_num_server", "dmlc_job_cluster", "report_stats", "force_local",
     "DMLC_COMMUNICATOR", "DMLC_WORKER_STOP_PROCESS_ON_ERROR"],
)
def test_compatibility_keys_are_ignored(key: str) -> None:
    value = "rabit" if "communicator" in key.lower() else "1"  # (the one it may name)
    assert load_config([f"{key}={value}"], {key: "rabit"}, environ={}) == Config()


# ----------------------------------------------------------------------------- mock


def test_mock_four_and_five_fields() -> None:
    cfg = load_config(["mock=0,1,2,3", "mock= 4, 5, 6, 7, 8192 "], environ={})
    assert cfg.mock == (MockSpec(0, 1, 2, 3), MockSpec(4, 5, 6, 7, 8192))
    assert cfg.mock[0].after_bytes == -1


def test_mock_from_kwargs_list_and_accumulation() -> None:
    cfg = load_config(["mock=1,0,0,0"], {"mock": ["2,0,0,0", "3,1,1,1,5"]}, environ={})
    assert cfg.mock == (MockSpec(1, 0, 0, 0), MockSpec(2, 0, 0, 0), MockSpec(3, 1, 1, 1, 5))
    assert load_config(kwargs={"MOCK": "0,0,0,0"}, environ={}).mock == (MockSpec(0, 0, 0, 0),)


@pytest.mark.parametrize("spec", ["", "1", "1,2,3", "1,2,3,4,5,6,7,8", "a,b,c,d", "1,2,3,x",
                                  "1,,2,3", "1.5,2,3,4", "1;2;3;4"])
def test_bad_mock_raises(spec: str) -> None:
    with pytest.raises(ValueError, match="mock"):
        load_config([f"mock={spec}"], environ={})


# ----------------------------------------------------------------------------- secret


def test_secret_hex_is_decoded() -> None:
    cfg = load_config(environ={"RABIT2_SECRET": "00ff10AB"})
    assert cfg.secret == b"\x00\xff\x10\xab"


@pytest.mark.parametrize("text", ["not hex!", "abc", "zz00", "pässwörd"])
def test_secret_plain_text_is_utf8(text: str) -> None:
    assert load_config([f"rabit2_secret={text}"], environ={}).secret == text.encode()


def test_secret_bytes_kwarg_is_taken_verbatim() -> None:
    assert load_config(kwargs={"rabit2_secret": b"deadbeef"}, environ={}).secret == b"deadbeef"
    assert load_config(kwargs={"rabit2_secret": "deadbeef"}, environ={}).secret == (
        b"\xde\xad\xbe\xef"
    )


# ----------------------------------------------------------------------------- bad values


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("dmlc_tracker_port", "http"),
        ("dmlc_num_attempt", "1.5"),
        ("dmlc_num_worker", ""),
        ("dmlc_worker_connect_retry", "many"),
        ("rabit_reduce_ring_mincount", "abc"),
        ("rabit_reduce_ring_mincount", "-1"),
        ("rabit_tree_reduce_minsize", "0"),
        ("rabit_tree_reduce_minsize", "-4"),
        ("rabit_timeout_sec", "0"),
        ("rabit_timeout_sec", "-1"),
        ("rabit_timeout_sec", "soon"),
        ("rabit2_connect_timeout_sec", "0"),
        ("rabit2_heartbeat_sec", "-0.5"),
        ("rabit2_link_timeout_sec", "0"),
        ("rabit2_ring_min_bytes", "-1"),
        ("rabit2_ring_min_bytes", "2M"),
        ("rabit2_link_timeout_sec", "never"),
        ("rabit2_loop", "trio"),
        ("rabit2_tcp_congestion", ""),
        ("rabit2_tcp_congestion", "reno; rm"),
        ("rabit2_log_level", "LOUD"),
        ("rabit2_log_level", ""),
        ("dmlc_tracker_port", "70000"),
        ("dmlc_tracker_port", "-1"),
        ("rabit_timeout_sec", "1e10"),
        ("rabit2_connect_timeout_sec", "1e10"),
        ("rabit2_link_timeout_sec", "1e308"),
        ("rabit2_recover_timeout_sec", "1000001"),
    ],
)
def test_bad_values_raise(key: str, value: str) -> None:
    with pytest.raises(ValueError):
        load_config([f"{key}={value}"], environ={})


def test_bad_kwarg_types_raise() -> None:
    with pytest.raises(ValueError):
        load_config(kwargs={"timeout_sec": [1]}, environ={})


@pytest.mark.parametrize(("key", "value"), [
    ("dmlc_tracker_port", 9091.7), ("dmlc_tracker_port", True), ("rabit_timeout_sec", True),
    ("rabit2_replay_mb", False), ("dmlc_tracker_port", 10**30),
])
def test_bools_and_fractions_are_not_numbers_of_a_setting(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=key):
        load_config(kwargs={key: value}, environ={})


def test_integral_floats_and_the_longest_timeout_are_taken() -> None:
    config = load_config(kwargs={"dmlc_tracker_port": 9091.0, "rabit_timeout_sec": 1e6},
                         environ={})
    assert (config.tracker_port, config.timeout_sec) == (9091, 1e6)


@pytest.mark.parametrize("args", ["dmlc_tracker_uri=127.0.0.1", b"rabit_timeout_sec=5",
                                  {"dmlc_tracker_uri": "127.0.0.1"}])
def test_args_that_are_not_a_list_of_strings_are_a_type_error(args: object) -> None:
    """A dict (XGBoost's worker_args()) or one string passed where rabit's list of 'k=v'
    strings goes would otherwise be read as nothing, and the worker would run alone."""
    with pytest.raises(TypeError, match=r"init\(\*\*params\)"):
        load_config(args, environ={})  # type: ignore[arg-type]


def test_bad_env_value_raises() -> None:
    with pytest.raises(ValueError, match="DMLC_TRACKER_PORT: expected an integer"):
        load_config(environ={"DMLC_TRACKER_PORT": "x"})


@pytest.mark.parametrize(("arg", "message"), [
    ("dmlc_retry=0", "^dmlc_retry must be >= 1"),  # (named as the caller spelled it)
    ("dmlc_worker_connect_retry=-1", "^dmlc_worker_connect_retry must be >= 1"),
    ("dmlc_num_worker=0", "expected a number of workers"),
    ("dmlc_num_worker=-5", "expected a number of workers"),
    ("dmlc_tracker_port=0", "expected a port number 1-65535"),
])
def test_numbers_below_their_least_raise(arg: str, message: str) -> None:
    """A worker told to try the tracker 0 times, expect no workers, or dial port 0."""
    with pytest.raises(ValueError, match=message):
        load_config([arg], environ={})
    assert load_config(["dmlc_num_worker=-1", "dmlc_retry=1"], environ={}).world_size == -1
    with pytest.raises(ValueError, match=r"^spin_us must be >= 0"):
        load_config(kwargs={"spin_us": -1}, environ={})


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf"])
@pytest.mark.parametrize("key", ["rabit_timeout_sec", "rabit2_connect_timeout_sec",
                                 "rabit2_heartbeat_sec", "rabit2_link_timeout_sec"])
def test_non_finite_seconds_raise(key: str, value: str) -> None:
    # a NaN deadline would never expire (now - last > nan is always False)
    with pytest.raises(ValueError, match="seconds"):
        load_config([f"{key}={value}"], environ={})


@pytest.mark.parametrize("uri", ["", "NULL"])
def test_null_tracker_uri_means_single_process(uri: str) -> None:
    cfg = load_config(environ={"DMLC_TRACKER_URI": uri})
    assert cfg.tracker_uri is None and not cfg.distributed
    # a later, explicit NULL turns a tracker from the environment off
    cfg = load_config([f"dmlc_tracker_uri={uri}"], environ={"DMLC_TRACKER_URI": "h"})
    assert not cfg.distributed


def test_mock_sixth_field_resets_a_link_instead_of_killing() -> None:
    config = load_config(["mock=1,0,2,0,4096,3"], environ={})
    assert config.mock[0].after_bytes == 4096 and config.mock[0].reset_peer == 3
    assert config.checksum == "auto"


def test_a_damage_mock_turns_checksums_on_where_they_were_left_to_the_link() -> None:
    """Links within one host carry no checksum under ``auto``: the damaged byte would go
    through unseen, and the job would end with one rank's result wrong."""
    assert load_config(["mock=1,0,2,0,4096,3,1"], environ={}).checksum == "on"
    assert load_config(["mock=1,0,2,0,4096,3,1", "rabit2_checksum=off"],
                       environ={}).checksum == "off"
    assert load_config(["mock=1,0,2,0,4096,3,1", "rabit2_checksum=auto"],
                       environ={}).checksum == "auto"  # (asked for: between hosts only)


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("true", True), ("0", False),
                                                 ("off", False)])
def test_recover_flag(value: str, expected: bool) -> None:
    assert load_config([f"rabit2_recover={value}"], environ={}).recover is expected
    assert load_config(environ={"RABIT2_RECOVER": value}).recover is expected


def test_local_replica_is_rabits_parameter() -> None:
    assert load_config(["rabit_local_replica=3"], environ={}).local_replica == 3
    with pytest.raises(ValueError, match="local_replica"):
        load_config(["rabit_local_replica=-1"], environ={})


def test_recover_flag_rejects_garbage_and_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="recover"):
        load_config(["rabit2_recover=maybe"], environ={})
    with pytest.raises(ValueError, match="recover_timeout_sec"):
        load_config(["rabit2_recover_timeout_sec=0"], environ={})
    with pytest.raises(ValueError, match="replay_mb"):
        load_config(["rabit2_replay_mb=-1"], environ={})


def test_spin_us_is_checked() -> None:
    assert Config().spin_us == 200
    with pytest.raises(ValueError, match="spin_us"):
        load_config(["rabit2_spin_us=-1"], environ={})
    with pytest.raises(ValueError, match="spin_us"):
        load_config(["rabit2_spin_us=fast"], environ={})


def test_congestion_control_default_system_and_bad_names() -> None:
    assert Config().tcp_congestion is None
    assert resolve_congestion("system") is None  # the kernel's default, untouched
    if not hasattr(socket, "TCP_CONGESTION"):
        assert resolve_congestion(None) is None
        with pytest.raises(ValueError, match="no TCP_CONGESTION"):
            resolve_congestion("reno")
        return
    # the default asks for reno and settles for the kernel's where it may not set it
    assert resolve_congestion(None) in ("reno", None)
    assert resolve_congestion("reno") == "reno"  # always built in, always permitted
    with pytest.raises(ValueError, match=r"rabit2_tcp_congestion='nosuchalgo'.*allowed"):
        resolve_congestion("nosuchalgo")


@pytest.mark.skipif(not hasattr(socket, "TCP_CONGESTION"), reason="Linux socket option")
def test_a_bad_congestion_control_fails_init_before_anything_connects() -> None:
    with pytest.raises(ValueError, match="nosuchalgo"):
        Engine(load_config(["rabit2_tcp_congestion=nosuchalgo"], environ={}))


@pytest.mark.parametrize("key", ["SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMIX_RANK",
                                 "PMI_RANK", "JOB_COMPLETION_INDEX"])
def test_task_id_falls_back_to_other_launchers_variables(key: str) -> None:
    assert load_config(environ={key: "3"}).task_id == "3"
    # DMLC_TASK_ID, when there, wins; so do the arguments
    assert load_config(environ={key: "3", "DMLC_TASK_ID": "7"}).task_id == "7"
    assert load_config(["dmlc_task_id=9"], environ={key: "3"}).task_id == "9"


def test_task_id_fallback_order_and_restart_count() -> None:
    env = {"PMI_RANK": "2", "SLURM_PROCID": "1", "OMPI_COMM_WORLD_RANK": "", "FOO": "x"}
    cfg = load_config(environ=env)
    assert cfg.task_id == "1" and cfg.num_attempt == 0  # srun's comes first; empty is unset
    cfg = load_config(environ={"SLURM_PROCID": "0", "SLURM_RESTART_COUNT": "2"})
    assert cfg.num_attempt == 2
    assert load_config(environ={"SLURM_RESTART_COUNT": "2",
                                "DMLC_NUM_ATTEMPT": "5"}).num_attempt == 5
    with pytest.raises(ValueError, match="DMLC_NUM_ATTEMPT: expected an integer"):
        load_config(environ={"SLURM_RESTART_COUNT": "many"})


def test_a_keyword_given_as_none_is_not_set() -> None:
    """As XGBoost's init: ``dmlc_tracker_uri=None`` means no tracker, not a host "None"."""
    cfg = load_config(kwargs={"dmlc_tracker_uri": None, "dmlc_retry": None,
                              "dmlc_tracker_port": None, "rabit_timeout_sec": None},
                      environ={})
    default = load_config(environ={})
    assert (cfg.tracker_uri, cfg.connect_retry, cfg.tracker_port, cfg.timeout_sec) == (
        default.tracker_uri, default.connect_retry, default.tracker_port, default.timeout_sec)
    with pytest.raises(ValueError, match="unknown rabit2 parameter 'rabit_timout_sec'"):
        load_config(kwargs={"rabit_timout_sec": None}, environ={})


def test_a_misspelled_rabit2_variable_is_pointed_out() -> None:
    """The environment is no argument list: an unknown RABIT2_ variable is no error, but one
    that looks like a known one gets a line saying which (a tool's own stays quiet)."""
    lines = misspelled_env({"RABIT2_RECOVR": "1", "RABIT2_TIMEOUT_SECS": "5",
                            "RABIT2_RECOVER": "1", "RABIT2_BIND_CPU": "0",
                            "RABIT2_SLOW": "1", "RABIT2_BENCH_XGB_ARGS": "x", "HOME": "/"})
    assert lines == ["RABIT2_RECOVR is not a rabit2 variable (ignored): RABIT2_RECOVER?",
                     "RABIT2_TIMEOUT_SECS is not a rabit2 variable (ignored): "
                     "RABIT2_TIMEOUT_SEC?"]

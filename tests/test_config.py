import threading

import pytest

import overlap_compile as oc
from overlap_compile import config


def test_defaults_match_design():
    o = config.current()
    assert o.enabled and o.min_speedup == 1.03 and o.profile == "auto" and o.search == "predict"
    assert (o.wave_group_first_max, o.wave_group_last_max) == (2, 4)
    assert o.signal_timeout_ms == 10000 and o.force_template is None and "signal_reorder" in o.templates


def test_patch_is_context_manager_and_decorator():
    with oc.config.patch(min_speedup=1.5) as o:
        assert o.min_speedup == 1.5 == config.current().min_speedup
        with oc.config.patch(force_template="signal_reorder"):
            assert config.current().min_speedup == 1.5
            assert config.current().force_template == "signal_reorder"
        assert config.current().force_template is None
    assert config.current().min_speedup == 1.03

    @oc.config.patch(search="exhaustive")
    def f():
        return config.current().search

    assert f() == "exhaustive" and config.current().search == "predict"


def test_patch_is_thread_local():
    seen = {}

    def other():
        seen["x"] = config.current().min_speedup

    with oc.config.patch(min_speedup=2.0):
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen["x"] == 1.03


@pytest.mark.parametrize(
    "key,value,allowed",
    [
        ("min_speedup", -1, "a number > 0"),
        ("min_speedup", "fast", "a number > 0"),
        ("min_saved_us", -1, "microseconds >= 0"),
        ("search", "guess", "'predict', 'exhaustive'"),
        ("templates", ["nope"], "a subset of"),
        ("force_template", "magic", "one of"),
        ("force_config", "[1, 2]", "a JSON object"),
        ("force_config", "{not json", "a JSON object"),
        ("force_config", {"chunks": 2}, "only together with force_template"),
        ("wave_group_first_max", 0, "an integer >= 1"),
        ("comm_priority", 3, "'highest' or an integer <= 0"),
        ("signal_timeout_ms", 0, "milliseconds, 1 to 2147483"),
        ("signal_timeout_ms", 2147484, "milliseconds, 1 to 2147483"),
        ("enabled", "maybe", "True or False"),
    ],
)
def test_bad_values_name_key_and_allowed(key, value, allowed):
    with pytest.raises(ValueError) as e:
        oc.config.patch(**{key: value})
    assert repr(key) in str(e.value) and allowed in str(e.value)


def test_unknown_option():
    with pytest.raises(ValueError, match="unknown overlap_compile option 'min_sped'"):
        oc.config.patch(min_sped=1)


def test_env_overrides(monkeypatch):
    monkeypatch.setenv("OVERLAP_COMPILE_MIN_SPEEDUP", "1.2")
    monkeypatch.setenv("OVERLAP_COMPILE_TEMPLATES", "p2p_ring,signal_reorder")
    monkeypatch.setenv("OVERLAP_COMPILE_ENABLED", "0")
    monkeypatch.setenv("OVERLAP_COMPILE_FORCE_TEMPLATE", "none")
    monkeypatch.setenv("OVERLAP_COMPILE_MIN_SAVED_US", "0")
    o = config.current()
    assert o.min_speedup == 1.2 and o.templates == ("signal_reorder", "p2p_ring") and o.enabled is False
    assert o.min_saved_us == 0.0
    assert o.force_template is None
    with oc.config.patch(min_speedup=1.1):  # a patch wins over the environment
        assert config.current().min_speedup == 1.1
    monkeypatch.setenv("OVERLAP_COMPILE_SEARCH", "bogus")
    with pytest.raises(ValueError, match=r"'search'.*environment variables OVERLAP_COMPILE_"):
        config.current()


def test_options_json_is_stable():
    assert config.Options().to_json() == config.Options().to_json()
    assert config.Options(min_speedup=1.1).to_json() != config.Options().to_json()


def test_environment_changes_are_seen_after_caching(monkeypatch):
    """Options built from the environment are cached per set of values (ops read them on every
    call): a changed, added or removed variable is still seen at the next read."""
    monkeypatch.setenv("OVERLAP_COMPILE_MIN_SPEEDUP", "1.25")
    first = config.current()
    assert first.min_speedup == 1.25 and config.current() is first
    monkeypatch.setenv("OVERLAP_COMPILE_MIN_SPEEDUP", "1.5")
    monkeypatch.setenv("OVERLAP_COMPILE_COMM_PRIORITY", "-2")
    assert (config.current().min_speedup, config.current().comm_priority) == (1.5, -2)
    monkeypatch.delenv("OVERLAP_COMPILE_MIN_SPEEDUP")
    assert config.current().min_speedup == 1.03


def test_force_config_takes_a_dict_or_json_text(monkeypatch):
    with oc.config.patch(force_template="p2p_ring", force_config={"transport": "p2p", "slices": 1}):
        assert config.current().force_config == '{"slices": 1, "transport": "p2p"}'
    monkeypatch.setenv("OVERLAP_COMPILE_FORCE_TEMPLATE", "priority_stream")
    monkeypatch.setenv("OVERLAP_COMPILE_FORCE_CONFIG", '{"chunks": 4}')
    assert config.current().force_config == '{"chunks": 4}'

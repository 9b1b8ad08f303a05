"""The options an app gets when it is built without the command line (tests, serve, benchmarks) are the
ones `kvtui` gets from an empty command line."""

from kvtui.options import DEFAULT_OPTIONS, SESSION_KEYS, AppConfig, build_session_config, run_command


def test_default_options_are_what_an_empty_command_line_gives():
    received = {}
    run_command(lambda **params: received.update(params)).main([], standalone_mode=False)
    assert DEFAULT_OPTIONS == {name: received[name] for name in SESSION_KEYS}


def test_an_app_built_without_flags_does_not_capture_attention():
    # --attention captures every layer's attention, O(heads x cache) per layer per step: opt-in everywhere
    options = AppConfig().options
    assert options["attention"] is False
    assert build_session_config(options).attention is False

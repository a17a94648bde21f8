"""Missing optional libraries: each adapter's config fails with one line that names the pip extra to install."""
import pytest

from megatron.rl.agent.env_config import EnvConfigError, build_agent_from_config
from megatron.rl.base.optional import MissingExtraError, import_optional


def test_import_optional(monkeypatch):
    assert import_optional("json", "x", "f").dumps([]) == "[]"
    monkeypatch.setitem(__import__("sys").modules, "some_pkg", None)  # a None entry makes the import fail
    with pytest.raises(MissingExtraError, match=r"^f needs the 'some_pkg' package, which is not installed: "
                                               r"pip install 'megatron-rl\[x\]'$"):
        import_optional("some_pkg", "x", "f")


@pytest.mark.parametrize("module, entry, extra", [
    ("reasoning_gym", {"type": "reasoning_gym", "args": {"task": "basic_arithmetic"}}, "envs"),
    ("openenv", {"type": "openenv", "args": {"environment": "json:loads"}}, "openenv"),
    ("transformers", {"type": "model_reward", "args": {"env": {"type": "arithmetic"},
                                                        "reward_model": {"path": "/nowhere"}}}, "hf"),
])
def test_missing_library_is_one_line_naming_the_extra(monkeypatch, module, entry, extra):
    import sys

    # the package and any submodule an earlier test imported (a cached submodule would import without it)
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")] or [module]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(EnvConfigError) as e:
        build_agent_from_config([entry])
    message = str(e.value)
    assert "\n" not in message and message.startswith("<env config>: environments[0]")
    assert f"needs the '{module}' package, which is not installed: pip install 'megatron-rl[{extra}]'" in message

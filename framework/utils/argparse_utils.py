"""``FlexibleArgumentParser``: vLLM's argument parser, for ``sparrow`` commands and users' scripts.

vLLM's examples build their command line as ``parser = FlexibleArgumentParser();
EngineArgs.add_cli_args(parser)``, and its users write flags three ways argparse alone does not
read. This parser reads them, and is the base of every ``sparrow`` command's parser:

- ``--max_model_len 64`` is ``--max-model-len 64``: a flag spelled with underscores is the dashed
  flag the parser knows (a flag defined with underscores keeps its own spelling);
- ``--speculative-config.method ngram --speculative-config.num_speculative_tokens 3`` builds a
  JSON flag's object key by key (each value is read as JSON where it parses, else kept as text);
  given beside ``--speculative-config '{...}'``, the keys are merged into that object;
- ``--config serve.yaml`` reads flags from a YAML mapping (flag name to value: ``true`` sets a
  switch, a list gives a multi-value flag its values, a mapping becomes a JSON flag's object);
  flags on the command line win over the file's;
- ``--help=KEYWORD`` shows only the flags whose name or help mentions the keyword (``--help=max``);
  ``--help=listgroup`` lists the flag groups and ``--help=GROUP`` shows one (``--help=server``);
  ``--help=all`` is ``--help``.

Under a parser with subcommands each subcommand's parser reads its own flags (``sparrow serve
--config f.yaml`` is read by ``serve``'s parser, which knows serve's flags).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

CONFIG_FLAG = "--config"


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` that also reads underscored flags, ``--flag.key value`` and
    ``--config FILE.yaml`` (see the module's docstring)."""

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        strings = list(sys.argv[1:] if args is None else args)
        for arg in strings[:self._own_args_end(strings)]:
            if arg.startswith("--help="):
                self._print_help_for(arg.partition("=")[2])
                self.exit(0)
        return super().parse_known_args(self._rewrite(strings), namespace)

    def _print_help_for(self, keyword: str) -> None:
        """vLLM's ``--help=KEYWORD``: a group's flags, the groups' names, or the flags that
        mention ``keyword`` in their name or help (case-insensitive; ``_`` reads as ``-``)."""
        groups = [group for group in self._action_groups if group._group_actions]
        wanted = keyword.strip().lower()
        if wanted in ("", "all"):
            self.print_help()
            return
        if wanted == "listgroup":
            print("flag groups (show one with --help=GROUP):")
            for group in groups:
                print(f"  {group.title}")
            return
        chosen = [group for group in groups if (group.title or "").lower() == wanted]
        if chosen:
            title, actions = chosen[0].title, chosen[0]._group_actions
        else:
            needle = wanted.replace("_", "-")
            title = f"flags matching {keyword!r}"
            actions = [action for action in self._actions if action.help != argparse.SUPPRESS and (
                any(needle in option.lower() for option in action.option_strings)
                or wanted in (action.help or "").lower())]
        if not actions:
            print(f"no flag or group matches {keyword!r}; --help=listgroup lists the groups")
            return
        formatter = self._get_formatter()
        formatter.start_section(title)
        formatter.add_arguments(actions)
        formatter.end_section()
        print(formatter.format_help(), end="")

    # -- the rewriting ----------------------------------------------------------------------------
    def _rewrite(self, args: list[str]) -> list[str]:
        """``args`` in argparse's own spelling. What follows a subcommand's name (or ``--``) is
        left to that subcommand's parser (or is positional) and kept as it is."""
        end = self._own_args_end(args)
        head, tail = args[:end], args[end:]
        head = self._read_config_files(head)
        return self._merge_dotted([self._dashed(arg) for arg in head]) + tail

    def _own_args_end(self, args: list[str]) -> int:
        commands: set[str] = set()
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                commands.update(action.choices)
        for index, arg in enumerate(args):
            if arg == "--" or arg in commands:
                return index
        return len(args)

    def _known(self, flag: str) -> bool:
        """Whether ``flag`` is one of this parser's options, or a prefix argparse would expand."""
        if flag in self._option_string_actions:
            return True
        return self.allow_abbrev and any(option.startswith(flag) for option in self._option_string_actions)

    def _dashed(self, arg: str) -> str:
        """``--max_model_len[=v]`` -> ``--max-model-len[=v]`` (also ``--hf_overrides.key``) where
        only the dashed name is this parser's."""
        if not arg.startswith("--") or "_" not in arg:
            return arg
        flag, eq, value = arg.partition("=")
        name, dot, keys = flag.partition(".")
        if "_" not in name or name in self._option_string_actions:
            return arg
        dashed = name.replace("_", "-")
        return f"{dashed}{dot}{keys}{eq}{value}" if self._known(dashed) else arg

    def _merge_dotted(self, args: list[str]) -> list[str]:
        """``--flag.a.b v`` (or ``--flag.a.b=v``) arguments folded into one ``--flag JSON``,
        placed where the flag (or its first key) was given."""
        out: list[str] = []
        objects: dict[str, dict[str, Any]] = {}  # flag -> the object its keys build
        slot: dict[str, int] = {}  # flag -> its index in `out`
        index = 0
        while index < len(args):
            arg = args[index]
            index += 1
            flag, eq, value = arg.partition("=")
            name, dot, keys = flag.partition(".")
            takes_one = (arg.startswith("--") and name in self._option_string_actions
                         and self._option_string_actions[name].nargs is None)
            if not takes_one:
                out.append(arg)
                continue
            if not dot:  # the flag itself: `--flag JSON` / `--flag=JSON`
                if not eq:
                    if index >= len(args):
                        out.append(arg)
                        continue
                    value = args[index]
                    index += 1
                if name in slot and name in objects:  # keys came first: start from this object
                    objects[name] = _merged(self._json_object(name, value), objects[name])
                    continue
                slot[name] = len(out)
                out.extend([name, value])
                continue
            if not keys or any(not key for key in keys.split(".")):
                self.error(f"argument {flag}: a key is empty (write {name}.KEY VALUE)")
            if not eq:
                if index >= len(args):
                    self.error(f"argument {flag}: expected one argument")
                value = args[index]
                index += 1
            nested: Any = _scalar(value)
            for key in reversed(keys.split(".")):
                nested = {key: nested}
            if name not in slot:
                slot[name] = len(out)
                out.extend([name, "{}"])
                objects[name] = {}
            elif name not in objects:  # given as `--flag JSON` before its keys
                objects[name] = self._json_object(name, out[slot[name] + 1])
            objects[name] = _merged(objects[name], nested)
        for name, merged in objects.items():
            out[slot[name] + 1] = json.dumps(merged)
        return out

    def _json_object(self, flag: str, text: str) -> dict[str, Any]:
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            self.error(f"argument {flag}: its keys are given as {flag}.KEY, so {flag} itself must be a JSON "
                       f"object, got {text!r}")
        return value

    # -- --config FILE ------------------------------------------------------------------------------
    def _read_config_files(self, args: list[str]) -> list[str]:
        """Every ``--config FILE`` replaced by nothing and the files' flags put first, so that the
        command line's own flags, parsed after them, win."""
        if CONFIG_FLAG in self._option_string_actions:  # the parser has a --config of its own
            return args
        from_files: list[str] = []
        rest: list[str] = []
        index = 0
        while index < len(args):
            arg = args[index]
            index += 1
            if arg == CONFIG_FLAG or arg.startswith(CONFIG_FLAG + "="):
                path = arg.partition("=")[2]
                if arg == CONFIG_FLAG:
                    if index >= len(args) or args[index].startswith("-"):
                        self.error(f"argument {CONFIG_FLAG}: expected a YAML file")
                    path = args[index]
                    index += 1
                from_files.extend(self._config_args(path))
            else:
                rest.append(arg)
        return from_files + rest

    def _config_args(self, path: str) -> list[str]:
        import yaml

        try:
            with open(path, encoding="utf-8") as handle:
                data = yaml.safe_load(handle)
        except OSError as exc:
            self.error(f"argument {CONFIG_FLAG}: cannot read {path!r}: {exc.strerror or exc}")
        except yaml.YAMLError as exc:
            self.error(f"argument {CONFIG_FLAG}: {path!r} is not valid YAML: {exc}")
        if data is None:
            return []
        if not isinstance(data, dict):
            self.error(f"argument {CONFIG_FLAG}: {path!r} must hold a mapping of flag names to values, "
                       f"got a {type(data).__name__}")
        args: list[str] = []
        for key, value in data.items():
            args.extend(self._config_entry(path, str(key), value))
        return args

    def _config_entry(self, path: str, key: str, value: Any) -> list[str]:
        """One ``key: value`` of a config file as command-line arguments."""
        name = key if key.startswith("-") else "--" + key
        if name not in self._option_string_actions:
            name = name[:2] + name[2:].replace("_", "-")
        action = self._option_string_actions.get(name)
        if action is None or name == CONFIG_FLAG:
            self.error(f"argument {CONFIG_FLAG}: {path!r} sets {key!r}, which is not a flag of `{self.prog}`")
        if value is None:  # `key:` with no value: not set
            return []
        if action.nargs == 0:  # a switch
            if not isinstance(value, bool):
                self.error(f"argument {CONFIG_FLAG}: {path!r} sets {key!r} to {value!r}; it is a switch, "
                           f"so its value is true or false")
            if isinstance(action, argparse.BooleanOptionalAction):
                return [name] if value else ["--no-" + name[2:]]
            return [name] if value == (action.const is not False) else []
        if isinstance(value, list):
            if action.nargs is None or action.nargs == argparse.OPTIONAL:
                if isinstance(action, argparse._AppendAction):
                    return [part for item in value for part in (name, _text(item))]
                return [name, json.dumps(value)]  # a JSON flag's list
            return [name, *(_text(item) for item in value)]
        return [name, _text(value)]


def _text(value: Any) -> str:
    """A config file's value as the text a flag is given: strings as they are, numbers as
    written, booleans, lists and mappings as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, dict, list)) or value is None:
        return json.dumps(value)
    return str(value)


def _scalar(text: str) -> Any:
    """A ``--flag.key`` value: JSON where it parses (numbers, true, objects), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _merged(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``update``'s keys set on it, nested objects merged key by key."""
    result = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = _merged(result[key], value)
        else:
            result[key] = value
    return result

"""Load tools from verl's tool config YAML.

.. code-block:: yaml

    tools:
      - class_name: "pkg.module.MyTool"      # a BaseTool subclass, or a plain typed function
        config: {}                           # passed to the class constructor
        tool_schema:                         # optional for functions (derived from the signature)
          type: function
          function: {name: my_tool, description: ..., parameters: {...}}
      - mcp:                                 # the tools of MCP servers (turnrl.tools.mcp)
          servers_file: mcp_servers.json     # {"mcpServers": {...}} (verl: mcp_servers_config_path)
          servers: {calc: {command: python, args: [calc_server.py]}}   # or inline; {url: ...} for HTTP
          tools: [add, search]               # optional selection (verl: tool_selected_list)
          prefix: false                      # name tools server__tool
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from turnrl.support.errors import describe
from turnrl.support.imports import ImportSpecError, import_object
from turnrl.tools.base import BaseTool, ToolSchema, normalize_schema
from turnrl.tools.files import read_data_file
from turnrl.tools.function import FunctionTool


class ToolConfigError(ValueError):
    """A tool config file or one of its entries is invalid."""


def load_tools_config(source: str | os.PathLike[str] | Mapping[str, Any]) -> list[BaseTool]:
    """Build the tools of a config: a YAML file path or the already loaded dict."""
    data = read_data_file(source, "tool config file", ToolConfigError)
    entries = data.get("tools") if isinstance(data, Mapping) else None
    if not isinstance(entries, list):
        raise ToolConfigError("tool config needs a 'tools' list")
    folder = Path.cwd() if isinstance(source, Mapping) else Path(source).parent
    tools: list[BaseTool] = []
    for i, entry in enumerate(entries):
        if isinstance(entry, Mapping) and "mcp" in entry:
            tools += _mcp_tools(entry["mcp"], i, folder)
        else:
            tools.append(_build_tool(entry, i))
    _check_unique([t.name for t in tools])
    return tools


def _mcp_tools(block: Any, index: int, folder: Path) -> list[BaseTool]:
    """The tools of an entry's MCP servers (connected now: their schemas are needed up front)."""
    from turnrl.tools.mcp import MCPError, mcp_tools, read_servers

    if not isinstance(block, Mapping):
        raise ToolConfigError(f"tools[{index}].mcp must be a mapping")
    known = {"servers", "servers_file", "mcp_servers_config_path", "tools", "tool_selected_list", "prefix",
             "start_timeout_s"}  # fmt: skip
    unknown = sorted(set(block) - known)
    if unknown:
        raise ToolConfigError(f"tools[{index}].mcp: unknown key(s) {unknown}")
    file = block.get("servers_file") or block.get("mcp_servers_config_path")
    try:
        servers = read_servers(folder / str(file) if file else block.get("servers") or {})
        select = block.get("tools") or block.get("tool_selected_list")
        timeout = float(block.get("start_timeout_s", 60.0))
        return list(mcp_tools(servers, select, bool(block.get("prefix", False)), timeout))
    except ImportError:
        raise ToolConfigError(f"tools[{index}].mcp needs the mcp SDK: pip install 'turnrl[envs]'") from None
    except MCPError as exc:
        raise ToolConfigError(f"tools[{index}].mcp: {exc}") from None


def _build_tool(entry: Any, index: int) -> BaseTool:
    if not isinstance(entry, Mapping) or not entry.get("class_name"):
        raise ToolConfigError(f"tools[{index}] needs a 'class_name'")
    class_name = str(entry["class_name"])
    where = f"tools[{index}] ({class_name})"
    schema = _schema(entry.get("tool_schema"), where)
    config = dict(entry.get("config") or {})
    try:
        obj = import_object(class_name, "tool class")
    except ImportSpecError as e:
        raise ToolConfigError(str(e)) from None
    try:
        tool = _instantiate(obj, config, schema, where)
        if not tool.name:  # a tool without a schema fails here, at load time
            raise ToolConfigError(f"{where}: the tool has an empty name")
    except ToolConfigError:
        raise
    except Exception as e:
        raise ToolConfigError(f"{where}: cannot build the tool: {describe(e)}") from e
    return tool


def _instantiate(obj: Any, config: dict[str, Any], schema: ToolSchema | None, where: str) -> BaseTool:
    if isinstance(obj, type) and issubclass(obj, BaseTool):
        return obj(config=config, tool_schema=schema)
    if isinstance(obj, BaseTool):
        if schema or config:
            raise ToolConfigError(f"{where} is already a tool instance; it takes no config or tool_schema")
        return obj
    if callable(obj) and not isinstance(obj, type):
        return FunctionTool(obj, tool_schema=schema, config=config)
    raise ToolConfigError(f"{where} is neither a BaseTool subclass nor a function")


def _schema(schema: Any, where: str) -> ToolSchema | None:
    if schema is None:
        return None
    if not isinstance(schema, Mapping):
        raise ToolConfigError(f"{where}: tool_schema must be a mapping")
    try:
        return normalize_schema(schema)
    except ValueError:
        raise ToolConfigError(f"{where}: tool_schema is missing function.name") from None


def _check_unique(names: list[str]) -> None:
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ToolConfigError(f"duplicate tool name(s) in config: {', '.join(duplicates)}")

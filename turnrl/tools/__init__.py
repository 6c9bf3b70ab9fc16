"""Tools: typed functions or BaseTool classes, tool-call parsers, and the YAML config loader."""

from turnrl.tools.base import (
    BaseTool,
    ExecuteResult,
    ParseResult,
    ToolArgumentError,
    ToolCall,
    ToolError,
    ToolOutput,
    ToolSchema,
    as_tool_output,
)
from turnrl.tools.builtin import calculator
from turnrl.tools.config import ToolConfigError, load_tools_config
from turnrl.tools.function import FunctionTool, function_schema, tool
from turnrl.tools.parsers import PARSERS, ToolParser, get_parser, register_parser, strip_reasoning

__all__ = [
    "PARSERS",
    "BaseTool",
    "ExecuteResult",
    "FunctionTool",
    "ParseResult",
    "ToolArgumentError",
    "ToolCall",
    "ToolConfigError",
    "ToolError",
    "ToolOutput",
    "ToolParser",
    "ToolSchema",
    "as_tool_output",
    "calculator",
    "function_schema",
    "get_parser",
    "load_tools_config",
    "register_parser",
    "strip_reasoning",
    "tool",
]

"""Chat encoding: the prompt once, observations as probed delta tokens, and the sanity check."""

from turnrl.chat.check import CheckMode, CheckResult
from turnrl.chat.encoder import ChatEncoder, ConversationEncoder
from turnrl.chat.probe import TemplateProbe, probe_template
from turnrl.chat.report import TemplateReport, check_template
from turnrl.chat.template import ChatTemplate, ChatTemplateError

__all__ = [
    "ChatEncoder",
    "ChatTemplate",
    "ChatTemplateError",
    "CheckMode",
    "CheckResult",
    "ConversationEncoder",
    "TemplateProbe",
    "TemplateReport",
    "check_template",
    "probe_template",
]

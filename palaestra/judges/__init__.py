"""Layer 2: group judges (RULER-style over any OpenAI-compatible endpoint), simulated judges, cache, audit."""

from palaestra.judges.audit import (
    DEFAULT_GATES,
    PAD_TEXT,
    AuditReport,
    audit_judge,
    kendall_tau,
    padded_copy,
    strip_padding,
)
from palaestra.judges.base import GroupJudge, JudgeConfigError, JudgeError, JudgeUsage
from palaestra.judges.cache import JudgeCache
from palaestra.judges.prompt import DEFAULT_RUBRIC, PROMPT_VERSION, ReplyError, Verdict
from palaestra.judges.ruler import RulerJudge, ruler_score_group
from palaestra.judges.simulated import SIM_VERSION, SimulatedJudge, completion_text, contains_number

__all__ = [
    "DEFAULT_GATES",
    "DEFAULT_RUBRIC",
    "PAD_TEXT",
    "PROMPT_VERSION",
    "SIM_VERSION",
    "AuditReport",
    "GroupJudge",
    "JudgeCache",
    "JudgeConfigError",
    "JudgeError",
    "JudgeUsage",
    "ReplyError",
    "RulerJudge",
    "SimulatedJudge",
    "Verdict",
    "audit_judge",
    "completion_text",
    "contains_number",
    "kendall_tau",
    "padded_copy",
    "ruler_score_group",
    "strip_padding",
]

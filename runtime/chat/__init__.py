"""Chat format layer: OpenAI chat requests <-> DeepSeek-V4.1/V4 prompts and outputs.

One job per module:
  errors.py     ChatFormatError / GrammarUnavailable (the server's HTTP 400s, naming the field)
  tokenizer.py  Tokenizer (tokenizer.json, special ids by spelling) + IncrementalDetokenizer
  encoding.py   ChatPromptBuilder: request body -> PreparedChat (prompt ids via deepseek-recipe)
  parser.py     ChatOutputParser: streamed text -> reasoning/content/tool-call deltas (DSML)
  grammar.py    GrammarFactory / GrammarState: structured output and forced tool calls (xgrammar)

docs/chat-format.md lists the request fields accepted and the defaults.
"""

from .encoding import (REASONING_EFFORTS, ChatFormatConfig, ChatPromptBuilder, PreparedChat,
                       SamplingParams, resolve_thinking)
from .errors import ChatFormatError, GrammarUnavailable
from .grammar import (GrammarFactory, GrammarState, MaskWorker, OutputConstraint,
                      ThinkingGrammarState, UnconstrainedState, make_grammar_state,
                      xgrammar_available)
from .parser import (ChatDelta, ChatOutputParser, ParsedMessage, ParsedToolCall, ParserOptions,
                     ToolCallDelta, parse_completion)
from .tokenizer import SPECIAL, IncrementalDetokenizer, SpecialTokenIds, Tokenizer

__all__ = [
    "ChatFormatConfig", "ChatPromptBuilder", "PreparedChat", "SamplingParams", "REASONING_EFFORTS",
    "resolve_thinking", "ChatFormatError", "GrammarUnavailable", "GrammarFactory", "GrammarState",
    "MaskWorker", "OutputConstraint", "ThinkingGrammarState", "UnconstrainedState",
    "make_grammar_state",
    "xgrammar_available", "ChatDelta", "ChatOutputParser", "ParsedMessage", "ParsedToolCall",
    "ParserOptions", "ToolCallDelta", "parse_completion", "SPECIAL", "IncrementalDetokenizer",
    "SpecialTokenIds", "Tokenizer",
]

"""Structured output: the output constrained to a JSON schema, a regex, a fixed set of choices or a grammar.

`formats.py` reads what a recipe or a prompt line asks for (`ResponseFormat`); `grammar.py` compiles it
with xgrammar and keeps, per request, the grammar's state over the committed tokens, which fills the
token masks of a step's rows; `masks.py` applies them to the target's logits inside the step. The tokens a grammar forces are proposed as host drafts by `drafts/forced.py` (jump-forward).
"""

"""Structured output: the output constrained to a JSON schema, a regex, a fixed set of choices or a grammar.

`formats.py` reads what a recipe or a prompt line asks for (`ResponseFormat`); `grammar.py` compiles it
with xgrammar and keeps, per request, the grammar's state over the committed tokens, which fills the
token masks of a step's rows (with the tokens it forces in place of drafts it refuses); `masks.py`
applies them to the target's logits inside the step. `drafts/forced.py` proposes the tokens a grammar
forces as host drafts (jump-forward).
"""

"""Tokens and templates: the tokenizer a runner loads, observation boundary tokens, the stop-string EOS rule,
tool calls in generated text, the start-up template probe and template parity."""

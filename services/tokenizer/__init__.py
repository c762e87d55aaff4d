"""The tokenizer service: chat template, tokenization with image spans, incremental detokenization."""

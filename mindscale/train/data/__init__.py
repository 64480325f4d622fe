"""Training data: preprocessing, the MindRecord dataset, held-out splits, SFT templates, tokenizers."""

"""The pretrain -> fine-tune chain: its stages, token labels, two clusters, the demo."""

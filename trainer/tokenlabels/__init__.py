"""VOLO token labeling: the labeler, label sets on disk, teacher, forward and loss."""

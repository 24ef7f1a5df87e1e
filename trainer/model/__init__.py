"""The model and what trains it: timm models, optimizer, EMA, loss, evaluation."""

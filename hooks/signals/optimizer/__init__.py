"""The optimizer's figures: update and gradient statistics, Adam's state and moments."""

"""Loss accounting: the weight each sample, modality and micro-batch gets in the loss."""

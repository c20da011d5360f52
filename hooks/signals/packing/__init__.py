"""Packed sequences: the samples of packed rows read from what the job passes its model
(:mod:`.boundaries`), and the boundary-leak signal (:mod:`.leak`): whether a packed
sample's outputs depend on another sample of its row."""

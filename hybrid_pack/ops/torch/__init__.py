"""Pure-torch backends: exact on packed input, forward and backward, on any device torch runs on."""

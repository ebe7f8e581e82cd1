"""Where and how the model runs: device choice, precision, and the allocator setting."""

"""The public functional transforms: init_master, grads_to_fp32, apply_update,
masters_to_model, accumulate, clip, finite, loss scales, policy, partition."""

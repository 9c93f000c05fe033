"""The plan's KV sizing takes the driver's bytes per token and the device's binding limit."""

from poot.engine.models.synthetic import synthetic_llama
from poot.engine.plan import DeviceInfo, fit_plan


def test_kv_blocks_follow_the_drivers_bytes_per_token():
    config = synthetic_llama(0).config
    device = DeviceInfo("numpy", "cpu", 2 << 20, 8)
    f32 = fit_plan(device, config, 0, kv_bytes_per_token=config.kv_bytes_per_token(4))
    f16 = fit_plan(device, config, 0, kv_bytes_per_token=config.kv_bytes_per_token(2))
    assert f32 == fit_plan(device, config, 0)  # float32 when the driver does not say
    assert f16.num_blocks == 2 * f32.num_blocks


def test_each_layers_kv_fits_one_binding():
    config = synthetic_llama(0).config
    limit = 64 << 10
    device = DeviceInfo("vulkan", "lavapipe", 1 << 30, 8, max_binding_bytes=limit, adapter="llvmpipe (Vulkan, CPU)")
    plan = fit_plan(device, config, 0)
    per_layer = plan.num_blocks * plan.block_size * config.kv_bytes_per_token() // config.num_layers
    assert 0 < per_layer <= limit
    assert plan.adapter == "llvmpipe (Vulkan, CPU)" and plan.backend == "vulkan"

use cachealloc::cuda::cudarc::CachedStream;
use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};

const SCALE: &str = r#"extern "C" __global__ void scale(float* x, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= a;
}"#;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let ctx = CudaContext::new(0)?;
    let stream = ctx.new_stream()?;
    let cache = CachedStream::new(&stream)?; // allocates like cudarc's CudaStream
    let module = ctx.load_module(cudarc::nvrtc::compile_ptx(SCALE)?)?;
    let scale = module.load_function("scale")?;
    let mut x = cache.clone_htod(&[1.0f32, 2.0, 3.0])?; // a CachedSlice<f32>
    let n = x.len() as i32;
    let mut launch = stream.launch_builder(&scale);
    launch.arg(&mut x).arg(&2.0f32).arg(&n);
    // SAFETY: the kernel touches `n` values of `x`.
    unsafe { launch.launch(LaunchConfig::for_num_elems(3)) }?;
    assert_eq!(x.to_vec()?, [2.0, 4.0, 6.0]);
    Ok(())
}

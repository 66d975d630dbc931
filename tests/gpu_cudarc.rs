//! cachealloc buffers through cudarc on a real GPU (feature `cudarc`): kernel
//! launches, cudarc's copies, views, and the ordering of uses on other streams
//! (reads see foreign writes, writes wait for foreign reads, and memory
//! used by another stream is not handed out again before that stream is
//! done). Skips itself without a GPU. Needs libnvrtc on the library path.

use cachealloc::cuda::cudarc::{CachedSlice, CachedStream};
use cachealloc::cuda::first_device_or_skip;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

const KERNELS: &str = r#"
extern "C" __global__ void add(float* x, float v, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += v;
}
// Spins for about `cycles` clock cycles, then sets every value to v.
extern "C" __global__ void slow_fill(float* x, float v, int n, long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) x[i] = v;
}
// Spins, then copies src to dst.
extern "C" __global__ void slow_copy(const float* src, float* dst, int n, long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) dst[i] = src[i];
}
"#;

/// About 100 ms of spinning on a ~2 GHz GPU: far longer than the host takes
/// to queue the next operations.
const SPIN: i64 = 200_000_000;

struct Gpu {
    ctx: Arc<CudaContext>,
    add: CudaFunction,
    slow_fill: CudaFunction,
    slow_copy: CudaFunction,
}

fn setup() -> Option<Gpu> {
    first_device_or_skip()?;
    let ctx = CudaContext::new(0).expect("cudarc context");
    let ptx = cudarc::nvrtc::compile_ptx(KERNELS).expect("NVRTC");
    let m = ctx.load_module(ptx).expect("module");
    Some(Gpu {
        add: m.load_function("add").unwrap(),
        slow_fill: m.load_function("slow_fill").unwrap(),
        slow_copy: m.load_function("slow_copy").unwrap(),
        ctx,
    })
}

fn cfg(n: usize) -> LaunchConfig {
    LaunchConfig::for_num_elems(n as u32)
}

/// `slow_fill` of `buf` with `v`, launched on `stream` through `device_ptr_mut`.
fn slow_fill_on(g: &Gpu, stream: &Arc<CudaStream>, buf: &mut CachedSlice<f32>, v: f32) {
    let n = buf.len() as i32;
    let (p, _guard) = buf.device_ptr_mut(stream);
    let mut l = stream.launch_builder(&g.slow_fill);
    l.arg(&p).arg(&v).arg(&n).arg(&SPIN);
    // SAFETY: the kernel writes n floats of the buffer.
    unsafe { l.launch(cfg(256)) }.unwrap();
}

#[test]
fn kernel_launch_copies_and_views() {
    let Some(g) = setup() else { return };
    let stream = g.ctx.new_stream().unwrap();
    let cache = CachedStream::new(&stream).unwrap();
    let host: Vec<f32> = (0..1000).map(|i| i as f32).collect();
    let mut x = cache.clone_htod(&host).unwrap();

    // The buffer itself as a kernel argument.
    let n = x.len() as i32;
    let mut l = stream.launch_builder(&g.add);
    l.arg(&mut x).arg(&1.0f32).arg(&n);
    // SAFETY: n floats.
    unsafe { l.launch(cfg(1000)) }.unwrap();

    // A view as a kernel argument: values 100..200 get another +10.
    {
        let mut v = x.slice_mut(100..200);
        let vn = v.len() as i32;
        let mut l = stream.launch_builder(&g.add);
        l.arg(&mut v).arg(&10.0f32).arg(&vn);
        // SAFETY: vn floats of the view.
        unsafe { l.launch(cfg(100)) }.unwrap();
    }
    let got = x.to_vec().unwrap();
    for (i, v) in got.iter().enumerate() {
        let want = i as f32 + 1.0 + if (100..200).contains(&i) { 10.0 } else { 0.0 };
        assert_eq!(*v, want, "value {i}");
    }

    // cudarc's own copies, into and out of cachealloc memory and views.
    let mut y = cache.alloc_zeros::<f32>(1000).unwrap();
    stream
        .memcpy_dtod(&x.slice(0..500), &mut y.slice_mut(500..))
        .unwrap();
    stream
        .memcpy_htod(&[7.0f32; 10], &mut y.slice_mut(..10))
        .unwrap();
    let back: Vec<f32> = stream.clone_dtoh(&y).unwrap();
    assert_eq!(&back[..10], &[7.0; 10]);
    assert!(back[10..500].iter().all(|&v| v == 0.0));
    assert_eq!(&back[500..], &got[..500]);
    let mut part = [0.0f32; 4];
    stream.memcpy_dtoh(&y.slice(500..504), &mut part).unwrap();
    assert_eq!(part, [got[0], got[1], got[2], got[3]]);

    // Fills: 2-, 4- and 8-byte values, and an empty buffer.
    y.fill(2.5).unwrap();
    assert!(y.to_vec().unwrap().iter().all(|&v| v == 2.5));
    let mut d = cache.alloc_zeros::<f64>(33).unwrap();
    d.fill(-1.25).unwrap();
    assert_eq!(d.to_vec().unwrap(), vec![-1.25; 33]);
    let mut h = cache.alloc_zeros::<u16>(7).unwrap();
    h.fill(0xabcd).unwrap();
    assert_eq!(h.to_vec().unwrap(), vec![0xabcd; 7]);
    let e = cache.alloc_zeros::<f32>(0).unwrap();
    assert!(e.is_empty() && e.to_vec().unwrap().is_empty());
    assert!(x.try_slice(990..1001).is_none());
}

#[test]
fn reads_on_the_own_stream_see_a_foreign_write() {
    let Some(g) = setup() else { return };
    let own = g.ctx.new_stream().unwrap();
    let other = g.ctx.new_stream().unwrap();
    let cache = CachedStream::new(&own).unwrap();
    let mut x = cache.alloc_zeros::<f32>(4096).unwrap();
    slow_fill_on(&g, &other, &mut x, 5.0);
    // Queued on `own` right away: it must wait for the fill on `other`.
    assert!(x.to_vec().unwrap().iter().all(|&v| v == 5.0));
}

#[test]
fn a_write_on_the_own_stream_waits_for_a_foreign_read() {
    let Some(g) = setup() else { return };
    let own = g.ctx.new_stream().unwrap();
    let other = g.ctx.new_stream().unwrap();
    let cache = CachedStream::new(&own).unwrap();
    let n = 4096;
    let mut x = cache.clone_htod(&vec![1.0f32; n]).unwrap();
    let mut z = CachedStream::new(&other)
        .unwrap()
        .alloc_zeros::<f32>(n)
        .unwrap();
    {
        let (src, _g1) = x.device_ptr(&other);
        let (dst, _g2) = z.device_ptr_mut(&other);
        let n32 = n as i32;
        let mut l = other.launch_builder(&g.slow_copy);
        l.arg(&src).arg(&dst).arg(&n32).arg(&SPIN);
        // SAFETY: n floats each.
        unsafe { l.launch(cfg(256)) }.unwrap();
    }
    // Overwrites x on its own stream while `other` still reads it (slowly).
    x.fill(9.0).unwrap();
    assert!(
        z.to_vec().unwrap().iter().all(|&v| v == 1.0),
        "the read saw the later write"
    );
    assert!(x.to_vec().unwrap().iter().all(|&v| v == 9.0));
}

/// A late write on another stream to a buffer that is dropped at once, then
/// a buffer of the same size on the own stream: the late write must not
/// reach it. With cudarc's event tracking the own stream waits for the write
/// when the buffer is dropped; without it, the allocator's record of the other
/// stream keeps the block out of reuse until that stream is done.
fn late_foreign_write_misses_reused_memory(ctx: Arc<CudaContext>, g: &Gpu) {
    let own = ctx.new_stream().unwrap();
    let other = ctx.new_stream().unwrap();
    let cache = CachedStream::new(&own).unwrap();
    let n = 1 << 20;
    for round in 0..3 {
        let mut x = cache.alloc_zeros::<f32>(n).unwrap();
        let x_addr = x.as_raw();
        slow_fill_on(g, &other, &mut x, 7.0);
        drop(x);
        let mut y = cache.alloc_zeros::<f32>(n).unwrap();
        y.fill(3.0).unwrap();
        other.synchronize().unwrap();
        own.synchronize().unwrap();
        let got = y.to_vec().unwrap();
        assert!(
            got.iter().all(|&v| v == 3.0),
            "round {round}: a foreign stream's late write reached reused memory \
             (x at {x_addr:#x}, y at {:#x})",
            y.as_raw()
        );
    }
}

#[test]
fn memory_used_by_another_stream_is_not_reused_early() {
    let Some(g) = setup() else { return };
    late_foreign_write_misses_reused_memory(g.ctx.clone(), &g);
}

#[test]
fn memory_used_by_another_stream_is_not_reused_early_without_event_tracking() {
    let Some(g) = setup() else { return };
    // A context object of its own (same primary context), so that the other
    // tests keep their tracking.
    let ctx = CudaContext::new(0).unwrap();
    // SAFETY: this test orders its streams itself (it synchronises both
    // before reading), and every buffer is created after the switch.
    unsafe { ctx.disable_event_tracking() };
    late_foreign_write_misses_reused_memory(ctx, &g);
}

#[test]
fn streams_of_the_primary_context_are_accepted() {
    let Some(g) = setup() else { return };
    assert!(CachedStream::new(&g.ctx.default_stream()).is_ok());
    assert!(CachedStream::new(&g.ctx.per_thread_stream()).is_ok());
    assert!(CachedStream::new(&g.ctx.new_stream().unwrap()).is_ok());
}

/// `fill` of the cust buffer type with 1-, 2-, 4-, 3- and 8-byte values (the
/// 3- and 8-byte ones go through a host copy), and `f16`/`bf16` slices with `half`.
#[test]
fn cached_buffer_fill_writes_every_value() {
    use cachealloc::cuda::{allocator, driver::Stream, CachedBuffer};
    if first_device_or_skip().is_none() {
        return;
    }
    let alloc = allocator(0).unwrap();
    alloc.device().bind_thread().unwrap();
    let stream = Stream::new(alloc.device()).unwrap();
    let mut a = CachedBuffer::<u8>::zeroed(alloc, 13, stream.id()).unwrap();
    a.fill(0x5a).unwrap();
    let mut b = CachedBuffer::<u16>::zeroed(alloc, 13, stream.id()).unwrap();
    b.fill(0x1234).unwrap();
    let mut c = CachedBuffer::<f32>::zeroed(alloc, 13, stream.id()).unwrap();
    c.fill(-3.5).unwrap();
    let mut d = CachedBuffer::<[u8; 3]>::zeroed(alloc, 13, stream.id()).unwrap();
    d.fill([1, 2, 3]).unwrap();
    let mut e = CachedBuffer::<u64>::zeroed(alloc, 13, stream.id()).unwrap();
    e.fill(0x0102_0304_0506_0708).unwrap();
    let mut ha = [0u8; 13];
    a.copy_to_host(&mut ha).unwrap();
    assert_eq!(ha, [0x5a; 13]);
    let mut hb = [0u16; 13];
    b.copy_to_host(&mut hb).unwrap();
    assert_eq!(hb, [0x1234; 13]);
    let mut hc = [0f32; 13];
    c.copy_to_host(&mut hc).unwrap();
    assert_eq!(hc, [-3.5; 13]);
    let mut hd = [[0u8; 3]; 13];
    d.copy_to_host(&mut hd).unwrap();
    assert_eq!(hd, [[1, 2, 3]; 13]);
    let mut he = [0u64; 13];
    e.copy_to_host(&mut he).unwrap();
    assert_eq!(he, [0x0102_0304_0506_0708; 13]);
    #[cfg(feature = "half")]
    {
        use half::{bf16, f16};
        let cache = CachedStream::new(&CudaContext::new(0).unwrap().default_stream()).unwrap();
        let mut f = cache.alloc_zeros::<f16>(9).unwrap();
        f.fill(f16::from_f32(1.5)).unwrap();
        assert_eq!(f.to_vec().unwrap(), vec![f16::from_f32(1.5); 9]);
        let mut g = cache.alloc_zeros::<bf16>(9).unwrap();
        g.fill(bf16::from_f32(-2.0)).unwrap();
        assert_eq!(g.to_vec().unwrap(), vec![bf16::from_f32(-2.0); 9]);
    }
}

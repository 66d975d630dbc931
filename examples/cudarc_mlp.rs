//! A 3-layer MLP trained on cudarc, with every activation and gradient from
//! cachealloc, side by side with the same loop on cudarc's own allocation
//! (`CudaStream::alloc`/`alloc_zeros`/`clone_htod`: the driver's
//! stream-ordered pool, `cuMemAllocAsync`).
//!
//! Forward and backward are cuBLAS SGEMMs (`cudarc::cublas`) and NVRTC-compiled
//! kernels (`cudarc::nvrtc`: bias+ReLU, its backward, softmax cross-entropy,
//! bias gradient, SGD update). The batch size changes every step (the same
//! sequence for every run), which is what a caching allocator has to absorb.
//! The data is a fixed random linear "teacher": labels are the argmax of
//! `T·x`, so the loss falls as the network learns it.
//!
//! Runs, each from the same initial weights:
//! - `cachealloc`: [`CachedStream`] buffers (`CachedSlice`) from the
//!   process-wide allocator (`CACHEALLOC_CONF`, default policy when unset).
//! - `cachealloc-expand`: the same from an allocator of its own with the
//!   `expandable` preset (segments grow page by page in one address range).
//! - `cudarc-pool`: cudarc on the device's default memory pool as the driver
//!   leaves it (release threshold 0: memory goes back to the driver at every
//!   synchronisation).
//! - `cudarc-pool-keep`: the same with the release threshold at its maximum
//!   (the pool keeps what it reserved, as a caching allocator does).
//!
//! Printed per scheme: the median step time (host clock over a whole step,
//! including the upload of the batch and the read-back of the loss), the peak
//! of reserved device memory — cachealloc's own statistics (`reserved_bytes`
//! peak) and the pool's `CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH` — and the loss
//! over the first and last ten steps.
//!
//! ```text
//! cargo run --release --features cudarc --example cudarc_mlp -- [STEPS] [HIDDEN] [MAX_BATCH] [ROUNDS]
//! ```
//! (defaults 300 2048 2048 3; the schemes take turns, one run each per round,
//! and the median is over all rounds' steps after each run's first ten). Needs libcuda, libnvrtc and libcublas on the
//! library path. Exits 1 if a run's loss did not fall.

use cachealloc::cuda::cudarc::{CachedSlice, CachedStream};
use cachealloc::cuda::CudaDevice;
use cachealloc::{CachingAllocator, Config};
use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::sys::{self, CUmemPool_attribute};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig,
    PushKernelArg,
};
use std::error::Error;
use std::sync::Arc;
use std::time::Instant;

type Res<T> = Result<T, Box<dyn Error>>;

const INPUT: usize = 256;
const CLASSES: usize = 10;
const LR: f32 = 0.05;

const KERNELS: &str = r#"
extern "C" __global__ void bias_act(float* h, const float* b, int rows, int cols, int relu) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * cols) {
        float v = h[i] + b[i % cols];
        h[i] = relu ? fmaxf(v, 0.0f) : v;
    }
}
extern "C" __global__ void relu_backward(float* g, const float* a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && a[i] <= 0.0f) g[i] = 0.0f;
}
extern "C" __global__ void softmax_xent(const float* z, const int* labels, float* loss,
                                        float* grad, int rows, int cols) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* zr = z + r * cols;
    float m = -1e30f;
    for (int j = 0; j < cols; j++) m = fmaxf(m, zr[j]);
    float s = 0.0f;
    for (int j = 0; j < cols; j++) s += expf(zr[j] - m);
    float lse = m + logf(s);
    int y = labels[r];
    loss[r] = lse - zr[y];
    for (int j = 0; j < cols; j++)
        grad[r * cols + j] = (expf(zr[j] - lse) - (j == y ? 1.0f : 0.0f)) / rows;
}
extern "C" __global__ void col_sum(const float* g, float* out, int rows, int cols) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    float s = 0.0f;
    for (int r = 0; r < rows; r++) s += g[r * cols + c];
    out[c] = s;
}
extern "C" __global__ void sgd(float* w, const float* g, float lr, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) w[i] -= lr * g[i];
}
"#;

/// Where a run's device memory comes from.
trait Backend {
    type F: DevicePtr<f32> + DevicePtrMut<f32>;
    type I: DevicePtr<i32>;
    fn stream(&self) -> &Arc<CudaStream>;
    /// `n` values a kernel or GEMM writes in full before reading.
    fn uninit(&self, n: usize) -> Res<Self::F>;
    fn upload(&self, v: &[f32]) -> Res<Self::F>;
    fn upload_i32(&self, v: &[i32]) -> Res<Self::I>;
    fn download(&self, b: &Self::F) -> Res<Vec<f32>>;
}

struct Cached(CachedStream);

impl Backend for Cached {
    type F = CachedSlice<f32>;
    type I = CachedSlice<i32>;
    fn stream(&self) -> &Arc<CudaStream> {
        self.0.stream()
    }
    fn uninit(&self, n: usize) -> Res<Self::F> {
        // SAFETY: every use below writes the buffer in full before reading it.
        Ok(unsafe { self.0.alloc(n)? })
    }
    fn upload(&self, v: &[f32]) -> Res<Self::F> {
        Ok(self.0.clone_htod(v)?)
    }
    fn upload_i32(&self, v: &[i32]) -> Res<Self::I> {
        Ok(self.0.clone_htod(v)?)
    }
    fn download(&self, b: &Self::F) -> Res<Vec<f32>> {
        Ok(b.to_vec()?)
    }
}

struct Pool(Arc<CudaStream>);

impl Backend for Pool {
    type F = CudaSlice<f32>;
    type I = CudaSlice<i32>;
    fn stream(&self) -> &Arc<CudaStream> {
        &self.0
    }
    fn uninit(&self, n: usize) -> Res<Self::F> {
        // SAFETY: as for `Cached`.
        Ok(unsafe { self.0.alloc(n)? })
    }
    fn upload(&self, v: &[f32]) -> Res<Self::F> {
        Ok(self.0.clone_htod(v)?)
    }
    fn upload_i32(&self, v: &[i32]) -> Res<Self::I> {
        Ok(self.0.clone_htod(v)?)
    }
    fn download(&self, b: &Self::F) -> Res<Vec<f32>> {
        Ok(self.0.clone_dtoh(b)?)
    }
}

struct Kernels {
    bias_act: CudaFunction,
    relu_backward: CudaFunction,
    softmax_xent: CudaFunction,
    col_sum: CudaFunction,
    sgd: CudaFunction,
}

fn grid(n: usize) -> LaunchConfig {
    LaunchConfig::for_num_elems(n as u32)
}

/// A small deterministic generator (the same data for every run).
struct Lcg(u64);

impl Lcg {
    fn next_u32(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) as u32
    }
    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        self.next_u32() as f32 / (1u64 << 31) as f32 - 1.0
    }
}

/// One layer's weights `[out, in]` (row-major) and bias `[out]`.
struct Layer<F> {
    w: F,
    b: F,
    inp: usize,
    out: usize,
}

struct Model<B: Backend> {
    layers: Vec<Layer<B::F>>,
}

/// `c[rows, n] = a[rows, k] · w[n, k]ᵀ` (row-major), i.e. column-major
/// `cᵀ = w · aᵀ`.
fn gemm_forward<B: Backend>(
    blas: &CudaBlas,
    a: &B::F,
    w: &B::F,
    c: &mut B::F,
    rows: usize,
    k: usize,
    n: usize,
) -> Res<()> {
    let cfg = GemmConfig {
        transa: CUBLAS_OP_T,
        transb: CUBLAS_OP_N,
        m: n as i32,
        n: rows as i32,
        k: k as i32,
        alpha: 1.0f32,
        lda: k as i32,
        ldb: k as i32,
        beta: 0.0f32,
        ldc: n as i32,
    };
    // SAFETY: the shapes match the buffers' lengths (rows·k, n·k, rows·n).
    unsafe { blas.gemm(cfg, w, a, c)? };
    Ok(())
}

fn launch_bias_act<B: Backend>(
    k: &Kernels,
    s: &Arc<CudaStream>,
    h: &mut B::F,
    b: &B::F,
    rows: usize,
    cols: usize,
    relu: bool,
) -> Res<()> {
    let (hp, _gh) = h.device_ptr_mut(s);
    let (bp, _gb) = b.device_ptr(s);
    let (r, c, relu) = (rows as i32, cols as i32, relu as i32);
    let mut l = s.launch_builder(&k.bias_act);
    l.arg(&hp).arg(&bp).arg(&r).arg(&c).arg(&relu);
    // SAFETY: the kernel reads and writes rows·cols values of h, cols of b.
    unsafe { l.launch(grid(rows * cols))? };
    Ok(())
}

/// One training step on a batch; returns the mean loss.
#[allow(clippy::too_many_arguments)]
fn step<B: Backend>(
    be: &B,
    blas: &CudaBlas,
    k: &Kernels,
    model: &mut Model<B>,
    x_host: &[f32],
    y_host: &[i32],
) -> Res<f32> {
    let s = be.stream().clone();
    let rows = y_host.len();
    let x = be.upload(x_host)?;
    let y = be.upload_i32(y_host)?;

    // Forward: activations[0] = x, then one per layer.
    let mut acts: Vec<B::F> = vec![x];
    let n_layers = model.layers.len();
    for (i, layer) in model.layers.iter().enumerate() {
        let mut h = be.uninit(rows * layer.out)?;
        gemm_forward::<B>(blas, &acts[i], &layer.w, &mut h, rows, layer.inp, layer.out)?;
        launch_bias_act::<B>(k, &s, &mut h, &layer.b, rows, layer.out, i + 1 < n_layers)?;
        acts.push(h);
    }

    // Loss and its gradient w.r.t. the logits.
    let mut loss = be.uninit(rows)?;
    let mut grad = be.uninit(rows * CLASSES)?;
    {
        let (zp, _g1) = acts[n_layers].device_ptr(&s);
        let (yp, _g2) = y.device_ptr(&s);
        let (lp, _g3) = loss.device_ptr_mut(&s);
        let (gp, _g4) = grad.device_ptr_mut(&s);
        let (r, c) = (rows as i32, CLASSES as i32);
        let mut l = s.launch_builder(&k.softmax_xent);
        l.arg(&zp).arg(&yp).arg(&lp).arg(&gp).arg(&r).arg(&c);
        // SAFETY: rows·CLASSES logits and gradients, rows labels and losses.
        unsafe { l.launch(grid(rows))? };
    }

    // Backward, last layer first; `grad` is dL/d(pre-activation) of layer i.
    for i in (0..n_layers).rev() {
        let (inp, out) = (model.layers[i].inp, model.layers[i].out);
        let a_in = &acts[i];
        // dW[out, inp] = gradᵀ · a_in: column-major dWᵀ = a_inᵀ · grad.
        let mut dw = be.uninit(out * inp)?;
        let cfg = GemmConfig {
            transa: CUBLAS_OP_N,
            transb: CUBLAS_OP_T,
            m: inp as i32,
            n: out as i32,
            k: rows as i32,
            alpha: 1.0f32,
            lda: inp as i32,
            ldb: out as i32,
            beta: 0.0f32,
            ldc: inp as i32,
        };
        // SAFETY: a_in is rows·inp, grad rows·out, dw out·inp.
        unsafe { blas.gemm(cfg, a_in, &grad, &mut dw)? };
        let mut db = be.uninit(out)?;
        {
            let (gp, _g1) = grad.device_ptr(&s);
            let (dp, _g2) = db.device_ptr_mut(&s);
            let (r, c) = (rows as i32, out as i32);
            let mut l = s.launch_builder(&k.col_sum);
            l.arg(&gp).arg(&dp).arg(&r).arg(&c);
            // SAFETY: rows·out gradients in, out sums out.
            unsafe { l.launch(grid(out))? };
        }
        if i > 0 {
            // d(a_in)[rows, inp] = grad · W: column-major = Wᵀ(col) · gradᵀ(col).
            let mut da = be.uninit(rows * inp)?;
            let cfg = GemmConfig {
                transa: CUBLAS_OP_N,
                transb: CUBLAS_OP_N,
                m: inp as i32,
                n: rows as i32,
                k: out as i32,
                alpha: 1.0f32,
                lda: inp as i32,
                ldb: out as i32,
                beta: 0.0f32,
                ldc: inp as i32,
            };
            // SAFETY: W is out·inp, grad rows·out, da rows·inp.
            unsafe { blas.gemm(cfg, &model.layers[i].w, &grad, &mut da)? };
            {
                let (dp, _g1) = da.device_ptr_mut(&s);
                let (ap, _g2) = a_in.device_ptr(&s);
                let n = (rows * inp) as i32;
                let mut l = s.launch_builder(&k.relu_backward);
                l.arg(&dp).arg(&ap).arg(&n);
                // SAFETY: rows·inp values each.
                unsafe { l.launch(grid(rows * inp))? };
            }
            grad = da; // the old gradient goes back to its allocator here
        }
        let layer = &mut model.layers[i];
        for (p, g, n) in [(&mut layer.w, &dw, out * inp), (&mut layer.b, &db, out)] {
            let (pp, _g1) = p.device_ptr_mut(&s);
            let (gp, _g2) = g.device_ptr(&s);
            let (lr, n32) = (LR, n as i32);
            let mut l = s.launch_builder(&k.sgd);
            l.arg(&pp).arg(&gp).arg(&lr).arg(&n32);
            // SAFETY: n parameters and n gradients.
            unsafe { l.launch(grid(n))? };
        }
    }
    let losses = be.download(&loss)?;
    Ok(losses.iter().sum::<f32>() / rows as f32)
}

/// Initial weights, the same for every run.
fn init_params(sizes: &[usize]) -> Vec<(Vec<f32>, Vec<f32>)> {
    let mut rng = Lcg(7);
    sizes
        .windows(2)
        .map(|io| {
            let scale = (2.0 / io[0] as f32).sqrt();
            let w = (0..io[0] * io[1]).map(|_| rng.uniform() * scale).collect();
            (w, vec![0.0; io[1]])
        })
        .collect()
}

/// Batch `i` of the sequence: `rows` inputs and their teacher labels.
fn batch(teacher: &[f32], step: usize, max_batch: usize) -> (Vec<f32>, Vec<i32>) {
    let mut rng = Lcg(1000 + step as u64);
    let rows = 32 + (rng.next_u32() as usize % (max_batch - 31));
    let x: Vec<f32> = (0..rows * INPUT).map(|_| rng.uniform()).collect();
    let y = x
        .chunks(INPUT)
        .map(|xr| {
            let score = |c: usize| -> f32 {
                teacher[c * INPUT..(c + 1) * INPUT]
                    .iter()
                    .zip(xr)
                    .map(|(t, v)| t * v)
                    .sum()
            };
            (0..CLASSES)
                .max_by(|&a, &b| score(a).total_cmp(&score(b)))
                .unwrap_or(0) as i32
        })
        .collect();
    (x, y)
}

/// What one run measured.
struct RunStats {
    /// Step times after the first ten, in ms.
    times: Vec<f64>,
    peak_reserved: u64,
    first_loss: f32,
    last_loss: f32,
}

/// Trains a fresh model (the same initial weights every time) on `batches`.
fn run<B: Backend>(
    be: &B,
    k: &Kernels,
    batches: &[(Vec<f32>, Vec<i32>)],
    sizes: &[usize],
    peak: impl Fn() -> Res<u64>,
) -> Res<RunStats> {
    let blas = CudaBlas::new(be.stream().clone())?;
    let mut model = Model::<B> {
        layers: init_params(sizes)
            .iter()
            .zip(sizes.windows(2))
            .map(|((w, b), io)| {
                Ok(Layer {
                    w: be.upload(w)?,
                    b: be.upload(b)?,
                    inp: io[0],
                    out: io[1],
                })
            })
            .collect::<Res<_>>()?,
    };
    let mut times = Vec::with_capacity(batches.len());
    let mut losses = Vec::with_capacity(batches.len());
    for (x, y) in batches {
        let t = Instant::now();
        losses.push(step(be, &blas, k, &mut model, x, y)?);
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    be.stream().synchronize()?;
    drop(model);
    let avg = |l: &[f32]| l.iter().sum::<f32>() / l.len() as f32;
    let ten = 10.min(losses.len());
    Ok(RunStats {
        times: times.split_off(ten.min(times.len() - 1)),
        peak_reserved: peak()?,
        first_loss: avg(&losses[..ten]),
        last_loss: avg(&losses[losses.len() - ten..]),
    })
}

/// Runs of one allocation scheme, summed up.
struct Summary {
    name: &'static str,
    times: Vec<f64>,
    peak_reserved: u64,
    first_loss: f32,
    last_loss: f32,
}

impl Summary {
    fn new(name: &'static str) -> Summary {
        Summary {
            name,
            times: Vec::new(),
            peak_reserved: 0,
            first_loss: 0.0,
            last_loss: 0.0,
        }
    }
    fn add(&mut self, r: RunStats) {
        self.times.extend(r.times);
        self.peak_reserved = self.peak_reserved.max(r.peak_reserved);
        self.first_loss = r.first_loss;
        self.last_loss = r.last_loss;
    }
    fn median_ms(&self) -> f64 {
        let mut t = self.times.clone();
        t.sort_by(f64::total_cmp);
        t.get(t.len() / 2).copied().unwrap_or(f64::NAN)
    }
}

/// The device's default memory pool (the one `cuMemAllocAsync` uses).
fn default_pool(ctx: &CudaContext) -> Res<sys::CUmemoryPool> {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: writes one pool handle into a valid local.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()).result()? };
    Ok(pool)
}

fn pool_attr(pool: sys::CUmemoryPool, attr: CUmemPool_attribute) -> Res<u64> {
    let mut v: u64 = 0;
    // SAFETY: the reserved-memory and threshold attributes are 64-bit values.
    unsafe { sys::cuMemPoolGetAttribute(pool, attr, (&mut v as *mut u64).cast()).result()? };
    Ok(v)
}

fn set_pool_attr(pool: sys::CUmemoryPool, attr: CUmemPool_attribute, mut v: u64) -> Res<()> {
    // SAFETY: as above; the reserved high watermark may only be set to 0 (a reset).
    unsafe { sys::cuMemPoolSetAttribute(pool, attr, (&mut v as *mut u64).cast()).result()? };
    Ok(())
}

/// Gives the pool's free memory back and restarts its high watermark.
fn reset_pool(ctx: &CudaContext, pool: sys::CUmemoryPool, threshold: u64) -> Res<()> {
    ctx.synchronize()?;
    set_pool_attr(
        pool,
        CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
        threshold,
    )?;
    // SAFETY: trims only memory the pool holds unused.
    unsafe { sys::cuMemPoolTrimTo(pool, 0).result()? };
    set_pool_attr(
        pool,
        CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
        0,
    )?;
    Ok(())
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

fn main() -> Res<()> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse())
        .collect::<Result<_, _>>()?;
    let steps = args.first().copied().unwrap_or(300).max(20);
    let hidden = args.get(1).copied().unwrap_or(2048);
    let max_batch = args.get(2).copied().unwrap_or(2048).max(64);
    let rounds = args.get(3).copied().unwrap_or(3).max(1);
    let sizes = [INPUT, hidden, hidden, CLASSES];

    if cudarc::driver::CudaContext::device_count().unwrap_or(0) == 0 {
        println!("skipping: no CUDA device");
        return Ok(());
    }
    let ctx = CudaContext::new(0)?;
    let stream = ctx.new_stream()?;
    let ptx = cudarc::nvrtc::compile_ptx(KERNELS)?;
    let module = ctx.load_module(ptx)?;
    let k = Kernels {
        bias_act: module.load_function("bias_act")?,
        relu_backward: module.load_function("relu_backward")?,
        softmax_xent: module.load_function("softmax_xent")?,
        col_sum: module.load_function("col_sum")?,
        sgd: module.load_function("sgd")?,
    };
    let mut rng = Lcg(99);
    let teacher: Vec<f32> = (0..CLASSES * INPUT).map(|_| rng.uniform()).collect();
    let batches: Vec<_> = (0..steps).map(|i| batch(&teacher, i, max_batch)).collect();
    println!(
        "{} on {}: MLP {:?}, {rounds} rounds of {steps} steps per scheme, batch 32..={max_batch} (changes every step)",
        env!("CARGO_PKG_NAME"),
        ctx.name()?,
        sizes
    );

    let pool = default_pool(&ctx)?;
    let pool_peak =
        || -> Res<u64> { pool_attr(pool, CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH) };
    let pool_be = Pool(stream.clone());
    // Warm-up (cuBLAS handles, module loading, clocks), not reported.
    run(&pool_be, &k, &batches[..20], &sizes, pool_peak)?;

    let cached = Cached(CachedStream::new(&stream)?);
    let alloc = cached.0.allocator();
    let cached_peak = || -> Res<u64> { Ok(alloc.stats().reserved_bytes.all().peak) };
    // A second allocator with expandable segments (pages mapped into one
    // growing range per pool), whatever CACHEALLOC_CONF says.
    let expandable = Config::preset("expandable").ok_or("no expandable preset")?;
    let exp_alloc: &'static CachingAllocator<CudaDevice> = Box::leak(Box::new(
        CachingAllocator::new(CudaDevice::new(0)?, expandable),
    ));
    let exp = Cached(CachedStream::with_allocator(exp_alloc, &stream)?);
    let exp_peak = || -> Res<u64> { Ok(exp_alloc.stats().reserved_bytes.all().peak) };
    println!(
        "cachealloc: {}={:?}",
        cachealloc::cuda::CONF_ENV,
        std::env::var(cachealloc::cuda::CONF_ENV).unwrap_or_else(|_| "(unset: default)".into())
    );
    let mut results = [
        Summary::new("cachealloc"),
        Summary::new("cachealloc-expand"),
        Summary::new("cudarc-pool"),
        Summary::new("cudarc-pool-keep"),
    ];
    // Rounds in turn, so that drifting clocks do not favour one scheme.
    for _ in 0..rounds {
        results[0].add(run(&cached, &k, &batches, &sizes, cached_peak)?);
        results[1].add(run(&exp, &k, &batches, &sizes, exp_peak)?);
        reset_pool(&ctx, pool, 0)?;
        results[2].add(run(&pool_be, &k, &batches, &sizes, pool_peak)?);
        reset_pool(&ctx, pool, u64::MAX)?;
        results[3].add(run(&pool_be, &k, &batches, &sizes, pool_peak)?);
        reset_pool(&ctx, pool, 0)?;
    }

    println!();
    println!(
        "{:<18} {:>14} {:>18} {:>12} {:>12}",
        "allocation", "median step ms", "peak reserved MiB", "loss first", "loss last"
    );
    let mut fell = true;
    for r in &results {
        println!(
            "{:<18} {:>14.3} {:>18.1} {:>12.4} {:>12.4}",
            r.name,
            r.median_ms(),
            mib(r.peak_reserved),
            r.first_loss,
            r.last_loss
        );
        fell &= r.last_loss < 0.8 * r.first_loss;
    }
    println!(
        "(peak reserved: cachealloc's reserved_bytes peak; the pool's CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)"
    );
    if !fell {
        eprintln!("error: the loss did not fall by 20% in every run");
        std::process::exit(1);
    }
    Ok(())
}

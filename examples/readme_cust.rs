use cachealloc::cuda::{self, driver::Stream, CachedBuffer};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let alloc = cuda::allocator(0)?; // device 0, configured by CACHEALLOC_CONF
    alloc.device().bind_thread()?;
    let stream = Stream::new(alloc.device())?;
    for batch in [512, 2048, 1024] {
        let mut x = CachedBuffer::<f32>::zeroed(alloc, batch * 1024, stream.id())?;
        x.copy_from_host(&vec![1.0; batch * 1024])?;
        let _ptr = x.as_device_ptr(); // a cust DevicePointer<f32> for kernel launches
    } // each buffer goes back to the cache when dropped
    println!("{}", alloc.fragmentation());
    Ok(())
}

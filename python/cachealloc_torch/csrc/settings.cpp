// PyTorch's allocator settings at run time: torch.cuda.memory.
// _set_allocator_settings(s) reaches the installed allocator, which applies
// what is safe to change while it runs and warns about the rest (Note
// [Run-time settings] in allocator/src/pytorch_conf.rs).
// (The class and what the parts share: allocator.h.)

#include "allocator.h"

namespace cachealloc {

// c10::CachingAllocator::setAllocatorSettings parses the string into
// PyTorch's own configuration, then calls the device configuration hook
// (the CUDA backend's parser). The hook is wrapped: PyTorch's parser first,
// as before (it checks the string, and PyTorch's host allocator reads what
// it keeps), then the installed allocator applies the same string.
void register_settings_hook() {
  using Config = c10::CachingAllocator::AcceleratorAllocatorConfig;
  std::function<void(const std::string&)> previous = Config::getConfigParserHook();
  Config::registerDeviceConfigParserHook(
      [previous](const std::string& conf) {
        if (previous) {
          previous(conf);
        }
        auto& a = instance();
        if (a != nullptr) {
          a->apply_settings(conf);
        }
      },
      {});
}

// Applies `conf` to the device's allocator `h` (init_mutex_ held); the
// notice about settings that stay as the allocator started goes to
// `notice` when it is empty so far.
void CacheallocAllocator::apply_settings_to(c10::DeviceIndex dev, void* h,
                                            const std::string& conf,
                                            std::string* notice) {
  char buf[1024];
  double fraction = -1;
  int64_t n = cachealloc_torch_apply_settings(h, conf.c_str(), &fraction, buf, sizeof buf);
  TORCH_CHECK_VALUE(n >= 0, last_error());
  if (fraction >= 0) {
    fractions_[dev] = fraction;
  }
  if (n > 0 && notice != nullptr && notice->empty()) {
    *notice = buf;
  }
}

// Every device in use gets the settings now, and a device used later when
// its allocator starts (main_handle).
void CacheallocAllocator::apply_settings(const std::string& conf) {
  std::string notice;
  {
    std::lock_guard<std::mutex> g(init_mutex_);
    uint64_t devs = devices_in_use_.load();
    debugf("run-time settings \"%s\" for the devices in use (mask %llx)", conf.c_str(),
           static_cast<unsigned long long>(devs));
    for (int d = 0; d < kMaxDevices; ++d) {
      if (devs & (1ull << d)) {
        apply_settings_to(static_cast<c10::DeviceIndex>(d), main_[d].load(), conf,
                          &notice);
      }
    }
    if (settings_.empty() || settings_.back() != conf) {
      settings_.push_back(conf);
    }
  }
  if (!notice.empty()) {
    TORCH_WARN(notice);
  }
}

}  // namespace cachealloc

//! The model's allocation step: what a malloc may return and when out of
//! memory is the right answer.

use super::*;
use cachealloc_core::{round_size, AllocError, Device, MemInfo, MAX_REQUEST, MIN_BLOCK};
use std::collections::BTreeSet;

impl Model {
    pub(super) fn malloc(
        &mut self,
        size: u64,
        stream: usize,
        before: &Before,
    ) -> Result<(), String> {
        let sid = self.streams[stream];
        let pending_before: BTreeSet<u64> = self.dev.pending_events().into_iter().collect();
        let stream_waits = self.alloc.stats().num_stream_waits;
        let res = self.alloc.malloc(size, sid);
        // An event a malloc records (another stream's work, waited for on
        // the device by the requesting stream) guards no block: a marker.
        for e in self.dev.pending_events() {
            if !pending_before.contains(&e) {
                self.markers.insert(e);
            }
        }
        if self.alloc.stats().num_stream_waits > stream_waits {
            self.saw("malloc made its stream wait for another on the device");
        }
        let valid = size > 0 && size <= MAX_REQUEST;
        match res {
            Ok(p) => {
                if !valid {
                    return Err(format!("malloc({size}) succeeded with {p}"));
                }
                self.mallocs += 1;
                let rounded = round_size(size, self.config.roundup_power2_divisions())
                    .ok_or("model: round_size failed")?;
                if p.0 % MIN_BLOCK != 0 {
                    return Err(format!("malloc({size}) returned {p}, not 512-aligned"));
                }
                if let Some(l) = self
                    .live
                    .iter()
                    .find(|l| overlaps(p.0, rounded, l.addr, l.span()))
                {
                    return Err(format!(
                        "malloc({size}) returned {p}+{rounded}, overlapping the live allocation {:#x}+{}",
                        l.addr,
                        l.span()
                    ));
                }
                let mut reused_guarded = false;
                for g in &self.guards {
                    let pending = g.events.iter().any(|&e| self.dev.is_pending(e));
                    reused_guarded |= !pending && overlaps(p.0, rounded, g.addr, g.size);
                    if overlaps(p.0, rounded, g.addr, g.size) && pending {
                        return Err(format!(
                            "malloc({size}) returned {p}+{rounded}, overlapping the block {:#x}+{} whose events {:?} have not completed",
                            g.addr, g.size, g.events
                        ));
                    }
                }
                if reused_guarded {
                    self.saw("malloc reuses a block once its events completed");
                }
                if self
                    .guards
                    .iter()
                    .any(|g| g.events.iter().any(|&e| self.dev.is_pending(e)))
                {
                    self.saw("malloc while a block is guarded");
                }
                let st = self.alloc.stats();
                if st.num_ooms != before.stats.num_ooms {
                    return Err("a successful malloc counted an OOM".into());
                }
                let c = self.dev.counters();
                if self.expandable {
                    if c.vmm_creates > before.counters.vmm_creates {
                        self.saw("malloc created pages");
                    } else if c.vmm_maps > before.counters.vmm_maps {
                        self.saw("malloc mapped pooled or moved pages");
                    } else {
                        self.saw("malloc on mapped pages");
                    }
                    if c.vmm_reserves > before.counters.vmm_reserves {
                        self.saw("malloc reserved a range");
                    }
                    if st.num_pages_reused_early > before.stats.num_pages_reused_early {
                        self.saw("malloc reused its stream's pages early");
                    }
                } else if st.num_device_alloc == before.stats.num_device_alloc {
                    self.saw("malloc from the cache");
                }
                if st.num_alloc_retries != before.stats.num_alloc_retries {
                    self.saw("malloc served after the flush");
                }
                // A block taken from another stream's range or segment
                // (`expandable_borrow`, `borrow_holes`) belongs to that
                // stream, used on the requesting one.
                let (mut owner, mut uses) = (stream, BTreeSet::new());
                if st.num_blocks_borrowed > before.stats.num_blocks_borrowed {
                    if !(self.key_is("expandable_borrow", "True") || self.config.borrow_holes()) {
                        return Err(format!("malloc({size}) borrowed with borrowing off"));
                    }
                    let snap = self.alloc.snapshot();
                    let seg = snap
                        .segments
                        .iter()
                        .find(|s| s.address.0 <= p.0 && p.0 < s.address.0 + s.total_size)
                        .ok_or(format!("borrowed block {p} lies in no segment"))?;
                    owner = self
                        .streams
                        .iter()
                        .position(|&s| s == seg.stream)
                        .ok_or(format!(
                            "borrowed block {p} lies in a range of an unknown stream"
                        ))?;
                    if owner == stream {
                        return Err(format!("malloc({size}) borrowed from its own stream"));
                    }
                    uses.insert(self.streams[stream]);
                    self.saw("malloc took another stream's free block");
                }
                if st.num_pages_shared > before.stats.num_pages_shared {
                    self.saw("malloc shared pages between granules");
                }
                let other_kind = st.num_other_kind_fits > before.stats.num_other_kind_fits;
                if other_kind {
                    self.check_other_kind_fit(before, size)?;
                    self.other_kind_blocks.insert(p.0);
                }
                let other_kind = self.other_kind_blocks.contains(&p.0);
                self.live.push(Live {
                    addr: p.0,
                    size,
                    rounded,
                    block: 0,
                    stream: owner,
                    uses,
                    other_kind,
                });
                Ok(())
            }
            Err(AllocError::ZeroSize) if size == 0 => self.unchanged(before, "malloc(0)"),
            Err(AllocError::SizeTooLarge(s)) if s == size && size > MAX_REQUEST => {
                self.unchanged(before, &format!("malloc({size}) (too large)"))
            }
            Err(AllocError::OutOfMemory(r)) if valid => {
                self.ooms += 1;
                let rounded = round_size(size, self.config.roundup_power2_divisions())
                    .ok_or("model: round_size failed")?;
                // The segment size is policy; the report names it, within sane bounds.
                let seg = r.segment_size;
                let c = &self.config;
                let max_seg = self.max_segment(rounded);
                if seg < rounded
                    || ((!c.caching() || self.expandable) && seg != rounded)
                    || seg > max_seg
                {
                    return Err(format!(
                        "the OOM report names a {seg}-byte segment for a request rounded to {rounded}"
                    ));
                }
                let st = self.alloc.stats();
                if st.num_ooms != before.stats.num_ooms + 1 {
                    return Err("an OOM was not counted in num_ooms".into());
                }
                if !self.key_is("oom_flush", "True") && !self.expandable {
                    // A graph pool's allocator: nothing cached is given back
                    // (the key concerns plain segments).
                    if st.num_alloc_retries != before.stats.num_alloc_retries
                        || self.dev.counters().frees != before.counters.frees
                    {
                        return Err(format!(
                            "OOM for malloc({size}) with oom_flush off released cached segments"
                        ));
                    }
                } else {
                    if st.num_alloc_retries != before.stats.num_alloc_retries + 1 {
                        return Err(format!(
                            "OOM for malloc({size}) without the flush-and-retry (num_alloc_retries {} → {})",
                            before.stats.num_alloc_retries, st.num_alloc_retries
                        ));
                    }
                    self.check_flushed_as(&format!("an OOM for malloc({size})"), !self.expandable)?;
                }
                let info: MemInfo = self.dev.mem_info().map_err(|e| e.to_string())?;
                let reserved = st.reserved_bytes.all().current;
                let attempts = self.attempts(before);
                // The device memory the request needs: its segment, or with
                // expandable segments its pages (the request plus at most one
                // page at each edge: a granule, unless big pages are mapped at
                // the edges whatever the pressure), less what the allocator
                // holds and can move under it (pooled pages, idle pages).
                let (need, largest_page) = if self.expandable {
                    let g = self.dev.vmm_granularity().ok_or("no granularity")?;
                    let page = self.config.expandable_page().div_ceil(g).max(1) * g;
                    let edge = if self.key_is("expandable_edges", "big") {
                        page
                    } else {
                        g
                    };
                    let spare = self.pooled_bytes() + self.idle_page_bytes(&self.alloc.snapshot());
                    ((rounded + 2 * edge).saturating_sub(spare), page)
                } else {
                    (seg, seg)
                };
                let injected = (attempts > 0 && self.fail_next >= attempts)
                    || self.fail_above.is_some_and(|l| largest_page > l);
                let device_full = info.free < need;
                let capped = self
                    .cap
                    .is_some_and(|cap| reserved.saturating_add(need) > cap);
                if injected {
                    self.saw("OOM: injected failure");
                }
                if device_full {
                    self.saw("OOM: device full");
                }
                if capped {
                    self.saw("OOM: cap");
                }
                if !(injected || device_full || capped) {
                    return Err(format!(
                        "OOM for malloc({size}) (segment {seg}, {need} bytes of new memory at most) though the device had {} free, reserved {reserved}, cap {:?}, no injected failure",
                        info.free, self.cap
                    ));
                }
                let want_report = (
                    size,
                    seg,
                    info.free,
                    info.total,
                    self.cap,
                    st.allocated_bytes.all().current,
                    reserved,
                );
                let got_report = (
                    r.requested,
                    r.segment_size,
                    r.device_free,
                    r.device_total,
                    r.cap,
                    r.allocated,
                    r.reserved,
                );
                if want_report != got_report {
                    return Err(format!(
                        "OOM report (requested, segment, free, total, cap, allocated, reserved) is {got_report:?}, expected {want_report:?}"
                    ));
                }
                if !r.to_string().contains("out of memory") {
                    return Err(format!("OOM message does not say so: {r}"));
                }
                Ok(())
            }
            Err(e) => Err(format!("malloc({size}) returned Err({e:?})")),
        }
    }
}

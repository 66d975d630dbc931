//! The old mappings of moved pages ([`Stale`]), by place and by page (to
//! keep at most [`MAX_SHADOWS_PER_PAGE`] per page: Note [Shadows per page]).

// Note [Shadows per page]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A page that moves keeps its old mapping (a shadow, `expandable_shadows`)
// until that address needs another page. In a program of many streams a
// page moves from range to range, one range per stream, and each range it
// leaves keeps a shadow that nothing ever maps over: a million streams
// left 4.7 million mappings of 30 pages (400 MB of host records, and as
// many mappings held by the driver). So a page keeps at most
// `MAX_SHADOWS_PER_PAGE` old mappings: a page that has them all leaves its
// old place unmapped when it moves, as without shadows
// (`Expandable::take_idle_pages`), one driver call where a shadow costs
// none. An old mapping that queued work may still use (the page was reused
// early, by its own stream) stays all the same; the next recycling round
// (`Expandable::retire_stale`) unmaps a crowded page's oldest ones that no
// queued work can touch any longer, down to the limit. (A page taken back
// to its shadow, `Expandable::take_back`, trades one for another.) The
// corpus's replays never hold more than 11 per page (multistream_infer),
// so the limit changes none of their figures.

use super::Place;
use crate::block::SegmentId;
use crate::fasthash::FastMap;
use std::collections::{BTreeMap, VecDeque};

/// The old mapping of a page mapped again elsewhere: reused early by a block
/// of the same stream before the stream's queued work was done with it
/// (stream order makes that safe; unmapped once a marker of the stream
/// recorded after `since` completed), or, with `expandable_shadows`, moved
/// away (a *shadow*: kept until its address needs another page, and the
/// page's way back there if it is idle when a block there needs it). The
/// allocator treats the granules as unmapped.
#[derive(Copy, Clone, Debug)]
pub(super) struct Stale {
    pub(super) seg: SegmentId,
    /// First granule and length in granules.
    pub(super) at: u32,
    pub(super) len: u32,
    pub(super) handle: u64,
    pub(super) slot: usize,
    /// When the free block holding the page became free.
    pub(super) since: u64,
}

/// Old mappings one page keeps at most (Note [Shadows per page]).
pub(super) const MAX_SHADOWS_PER_PAGE: usize = 32;

/// The old mappings, by place, with each page's places in the order made.
#[derive(Default)]
pub(super) struct StaleMap {
    by_place: BTreeMap<Place, Stale>,
    /// Per page (handle): the places of its old mappings, oldest first.
    by_page: FastMap<u64, VecDeque<Place>>,
    /// Pages that may have more than [`MAX_SHADOWS_PER_PAGE`] old mappings.
    crowded: Vec<u64>,
}

impl StaleMap {
    pub fn is_empty(&self) -> bool {
        self.by_place.is_empty()
    }

    pub fn get(&self, place: &Place) -> Option<&Stale> {
        self.by_place.get(place)
    }

    /// The old mapping at `place` (there is one).
    pub fn at(&self, place: &Place) -> Stale {
        self.by_place[place]
    }

    pub fn insert(&mut self, place: Place, st: Stale) {
        if let Some(old) = self.by_place.insert(place, st) {
            self.unlist(old.handle, place);
        }
        let places = self.by_page.entry(st.handle).or_default();
        places.push_back(place);
        if places.len() > MAX_SHADOWS_PER_PAGE {
            self.crowded.push(st.handle);
        }
    }

    /// Whether page `handle` may leave one more shadow (fewer than
    /// [`MAX_SHADOWS_PER_PAGE`] old mappings).
    #[inline]
    pub fn has_room(&self, handle: u64) -> bool {
        self.by_page
            .get(&handle)
            .map_or(true, |p| p.len() < MAX_SHADOWS_PER_PAGE)
    }

    pub fn remove(&mut self, place: &Place) -> Option<Stale> {
        let st = self.by_place.remove(place)?;
        self.unlist(st.handle, *place);
        Some(st)
    }

    fn unlist(&mut self, handle: u64, place: Place) {
        if let Some(places) = self.by_page.get_mut(&handle) {
            if let Some(i) = places.iter().position(|p| *p == place) {
                places.remove(i);
            }
            if places.is_empty() {
                self.by_page.remove(&handle);
            }
        }
    }

    /// The old mappings in `range` of places, in order.
    pub fn range(
        &self,
        range: std::ops::Range<Place>,
    ) -> impl DoubleEndedIterator<Item = (&Place, &Stale)> + '_ {
        self.by_place.range(range)
    }

    /// Every old mapping, by place.
    pub fn values(&self) -> impl Iterator<Item = &Stale> + '_ {
        self.by_place.values()
    }

    /// Every place with an old mapping, in order.
    pub fn places(&self) -> Vec<Place> {
        self.by_place.keys().copied().collect()
    }

    /// The places of page `handle`'s old mappings, oldest first.
    pub fn of_page(&self, handle: u64) -> Vec<Place> {
        self.by_page
            .get(&handle)
            .map(|p| p.iter().copied().collect())
            .unwrap_or_default()
    }

    /// The oldest old mappings of pages with more than
    /// [`MAX_SHADOWS_PER_PAGE`], as many as they have beyond it (to unmap
    /// where no queued work can touch them). Each crowded page is told
    /// once, until an old mapping is added to it again.
    #[inline]
    pub fn over_limit(&mut self) -> Vec<Place> {
        if self.crowded.is_empty() {
            return Vec::new();
        }
        self.over_limit_slow()
    }

    #[cold]
    fn over_limit_slow(&mut self) -> Vec<Place> {
        let mut out = Vec::new();
        let mut pages = std::mem::take(&mut self.crowded);
        pages.sort_unstable();
        pages.dedup();
        for h in pages {
            if let Some(places) = self.by_page.get(&h) {
                let extra = places.len().saturating_sub(MAX_SHADOWS_PER_PAGE);
                out.extend(places.iter().take(extra).copied());
            }
        }
        out
    }

    /// Checks that the two indexes hold the same old mappings.
    pub fn check(&self) -> Result<(), String> {
        let listed: usize = self.by_page.values().map(VecDeque::len).sum();
        if listed != self.by_place.len() {
            return Err(format!(
                "{} old mappings by page, {} by place",
                listed,
                self.by_place.len()
            ));
        }
        for (h, places) in &self.by_page {
            for p in places {
                if self.by_place.get(p).map(|st| st.handle) != Some(*h) {
                    return Err(format!("old mapping {p:?} listed under page {h}"));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::SegmentId;

    fn place(seg: u32, at: u32) -> Place {
        Place {
            seg: SegmentId(seg),
            at,
        }
    }

    fn shadow(seg: u32, at: u32, handle: u64) -> Stale {
        Stale {
            seg: SegmentId(seg),
            at,
            len: 1,
            handle,
            slot: 0,
            since: 0,
        }
    }

    /// A page has room for shadows up to the limit, and again once one
    /// goes; both indexes agree through inserts, replacements and removals.
    #[test]
    fn a_page_has_room_for_a_limited_number_of_shadows() {
        let mut m = StaleMap::default();
        for i in 0..MAX_SHADOWS_PER_PAGE as u32 {
            assert!(m.has_room(7));
            // Page 7 moves through ranges 1000, 999, ...; other pages by.
            m.insert(place(1000 - i, 0), shadow(1000 - i, 0, 7));
            m.insert(place(i, 3), shadow(i, 3, u64::from(100 + i)));
        }
        m.check().unwrap();
        assert!(!m.has_room(7) && m.has_room(100));
        assert!(m.over_limit().is_empty(), "at the limit, not past it");
        // Reused early: an old mapping past the limit, the oldest told.
        m.insert(place(900, 0), shadow(900, 0, 7));
        assert_eq!(m.over_limit(), vec![place(1000, 0)]);
        assert!(m.over_limit().is_empty(), "told once");
        assert_eq!(m.remove(&place(900, 0)).map(|st| st.handle), Some(7));
        assert_eq!(m.of_page(7)[0], place(1000, 0), "oldest first");
        assert_eq!(m.remove(&place(995, 0)).map(|st| st.handle), Some(7));
        assert!(m.has_room(7));
        // A new mapping at a place replaces the old one in both indexes.
        m.insert(place(0, 3), shadow(0, 3, 7));
        assert!(m.of_page(100).is_empty() && !m.has_room(7));
        m.check().unwrap();
        for p in m.places() {
            m.remove(&p);
        }
        assert!(m.is_empty() && m.by_page.is_empty());
        m.check().unwrap();
    }
}

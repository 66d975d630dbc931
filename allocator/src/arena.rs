//! `Arena<T>`: the allocator's record store (blocks, segments), a vector
//! whose vacated slots are reused, indexed by `u32` ids.

/// A vector with reusable slots, indexed by `u32`.
#[derive(Debug)]
pub(crate) struct Arena<T> {
    items: Vec<Option<T>>,
    vacant: Vec<u32>,
    len: usize,
}

impl<T> Default for Arena<T> {
    fn default() -> Self {
        Arena {
            items: Vec::new(),
            vacant: Vec::new(),
            len: 0,
        }
    }
}

impl<T> Arena<T> {
    pub fn insert(&mut self, item: T) -> u32 {
        self.len += 1;
        if let Some(i) = self.vacant.pop() {
            self.items[i as usize] = Some(item);
            i
        } else {
            self.items.push(Some(item));
            u32::try_from(self.items.len() - 1).expect("more than 4 billion records")
        }
    }

    /// Removes the item at `i` in place, without moving it out: for callers
    /// that do not need it (a merged block record).
    pub fn discard(&mut self, i: u32) {
        let slot = &mut self.items[i as usize];
        assert!(slot.is_some(), "arena slot vacant");
        *slot = None;
        self.vacant.push(i);
        self.len -= 1;
    }

    pub fn remove(&mut self, i: u32) -> T {
        let item = self.items[i as usize].take().expect("arena slot vacant");
        self.vacant.push(i);
        self.len -= 1;
        item
    }

    #[inline]
    pub fn get(&self, i: u32) -> &T {
        self.items[i as usize].as_ref().expect("arena slot vacant")
    }

    #[inline]
    pub fn get_mut(&mut self, i: u32) -> &mut T {
        self.items[i as usize].as_mut().expect("arena slot vacant")
    }

    pub fn len(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arena_reuses_slots() {
        let mut s = Arena::default();
        let a = s.insert("a");
        let b = s.insert("b");
        assert_eq!(s.remove(a), "a");
        let c = s.insert("c");
        assert_eq!(c, a);
        assert_eq!(*s.get(b), "b");
        assert_eq!(s.len(), 2);
        s.discard(b);
        assert_eq!(s.len(), 1);
        assert_eq!(s.insert("d"), b);
    }
}

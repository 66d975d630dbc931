//! Free-block bins: a two-level segregated fit (TLSF) index with exact best fit.
//!
//! The first level is ⌊log2⌋ of the size in 512-byte granules, the second
//! splits each power-of-two range into 64 linear classes; one bitmap per
//! level finds the first non-empty class at or above a size in O(1). Inside a
//! class, blocks are ordered by (size, address), so the answer is exactly
//! PyTorch's best fit: the smallest block that fits, lowest address on ties.
//! Classes are narrow (1/64 of a power of two), so most hold no block or
//! one: the first block sits in the class record itself, so that the common
//! insert, lookup and removal touch one 32-byte record and nothing else. The
//! rest of a class is a sorted vector (binary search, short moves) until it
//! grows past `SPILL` entries, then an ordered tree, so that a pathological
//! pile of same-sized free blocks stays O(log n): one class is a [`Class`]
//! (`bins/class.rs`).
//!
//! A pool's bins cost what the pool holds (Note [Bins sized by use]): the
//! classes that hold blocks, in a short sorted list while there are few,
//! else the bitmaps and a row of classes per power of two that held one.

use crate::block::BlockId;
use crate::rounding::MIN_BLOCK;

mod class;

use class::Class;
#[cfg(test)]
use class::SPILL;

/// Second-level classes per power of two: 64 rather than 32 leaves fewer
/// classes holding more than one block, which is where the random mix's
/// branches on a class's length mispredicted (cachegrind: 3.5 → 3.0 per op).
const SL_BITS: u32 = 6;
/// A second-level bitmap: one bit per class of a first-level range.
type SlMap = u64;
const SL_COUNT: usize = 1 << SL_BITS;
/// First-level classes: granule counts up to 2^48 (far above any device).
const FL_COUNT: usize = 48;

/// A free block as the bins store it. The derived order, by size, then
/// address, then block, is the bins' order: best fit first.
#[derive(Copy, Clone, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub(crate) struct Entry {
    /// The block's size in bytes.
    pub size: u64,
    /// The block's address.
    pub addr: u64,
    pub id: BlockId,
}

/// Where [`Bins::find`] found a block: where its class lies, the class,
/// its index there (a hint), and the entry.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Found {
    /// The class's slot (compact form) or place in the table's rows.
    at: u32,
    /// The flat class index.
    class: u32,
    index: u32,
    pub entry: Entry,
}

impl Found {
    #[inline(always)]
    fn new(at: usize, class: usize, index: usize, entry: Entry) -> Self {
        Found {
            at: at as u32,
            class: class as u32,
            index: index as u32,
            entry,
        }
    }
}

/// A row of the table: the classes of one first-level class, aligned to a
/// cache line (so each class to 32 bytes).
#[derive(Debug)]
#[repr(align(64))]
struct Row([Class; SL_COUNT]);

const _: () = assert!(std::mem::size_of::<Row>() == SL_COUNT * 32);

impl<'a> IntoIterator for &'a Row {
    type Item = &'a Class;
    type IntoIter = std::slice::Iter<'a, Class>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

/// The table's rows, indexed by a class's place: its row's index times
/// [`SL_COUNT`] plus its second-level class.
#[derive(Debug, Default)]
struct Rows(Vec<Row>);

impl std::ops::Index<usize> for Rows {
    type Output = Class;
    #[inline(always)]
    fn index(&self, at: usize) -> &Class {
        &self.0[at / SL_COUNT].0[at % SL_COUNT]
    }
}

impl std::ops::IndexMut<usize> for Rows {
    #[inline(always)]
    fn index_mut(&mut self, at: usize) -> &mut Class {
        &mut self.0[at / SL_COUNT].0[at % SL_COUNT]
    }
}

impl Rows {
    /// A row of empty classes at row index `i`.
    fn insert_row(&mut self, i: usize) {
        self.0
            .insert(i, Row(std::array::from_fn(|_| Class::default())));
    }

    /// Class records allocated.
    #[cfg(test)]
    fn capacity(&self) -> usize {
        self.0.capacity() * SL_COUNT
    }

    /// The classes in place order.
    fn iter(&self) -> std::iter::Flatten<std::slice::Iter<'_, Row>> {
        self.0.iter().flatten()
    }
}

// Note [Bins sized by use]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A program may use a million streams, each holding a block or two in each
// of its pools. A table of every class per pool (3,072 × 32 bytes) would
// cost 96 KiB a pool whatever the pool holds: a million streams' pools
// could not be held on the host at all. So a pool's bins cost what the
// pool holds, in one of two forms:
//
// - `Few`: while at most [`FEW`] classes hold blocks, only those classes
//   are kept, ascending, beside their indices in a 16-byte array: "the first
//   class at or above c" is one count of the indices below c (eight
//   compares, no branch on the data), and a class record is found at that
//   count. A class that empties keeps its slot until a new class needs it
//   (a pair of malloc and free empties and fills the same few classes). A
//   pool of one block costs its `Bins` record (64 bytes, inline in the
//   allocator's table of pools) and one class record.
// - `Table`: past [`FEW`] classes holding blocks at once, the two-level
//   table: the bitmaps, and
//   rows of 64 classes, one per first-level class (power of two) that has
//   held a block, made on the first block of that range (2 KiB each, 48 at
//   most, where a full table is 96 KiB). A class is found through its row's
//   offset, which loads beside the table's own pointer, so a lookup costs
//   what it costs in a full table: the bitmaps, one class record.
//
// A busy pool (a single-stream program's, within its first steps) moves to
// `Table` once and stays there, so that a pool that fills and drains does
// not build and drop tables. The allocator drops a pool's bins altogether
// when the release of a segment leaves them empty (`Core::unfile_released`):
// a pool that holds nothing costs its inline record only.
//
// Both forms keep the same order and answer the same best fit, so which form
// a pool is in never changes a decision (checked by
// `both_forms_agree_with_an_ordered_set` below).

/// Classes a pool's bins hold in the compact form at most (Note [Bins
/// sized by use]): past this, the two-level table.
const FEW: usize = 8;

/// A first-level class with no row of classes in a [`Table`] yet.
const NO_ROW: u32 = u32::MAX;

/// The bins of one pool (Note [Bins sized by use]).
#[derive(Debug)]
pub(crate) struct Bins {
    form: Form,
    len: usize,
    bytes: u64,
}

#[derive(Debug)]
enum Form {
    Few(Few),
    Table(Box<Table>),
}

impl Default for Bins {
    fn default() -> Self {
        Bins {
            form: Form::Few(Few::default()),
            len: 0,
            bytes: 0,
        }
    }
}

/// The compact form: the classes a pool has held blocks in, ascending (at
/// most [`FEW`]), and which of them hold blocks now.
#[derive(Debug)]
struct Few {
    /// Flat class indices, ascending; unused entries are `u16::MAX`
    /// (above every class, so they never count as below one).
    ids: [u16; FEW],
    /// Bit `p`: the class of slot `p` holds a block. A class that empties
    /// keeps its slot (no move of records when a pool's few classes empty
    /// and fill again, as a pair of malloc and free does), until a new
    /// class needs the slot.
    full: SlotMask,
    /// The classes of `ids`, in the same order.
    classes: Vec<Class>,
}

/// One bit per slot of the compact form.
type SlotMask = u8;
const _: () = assert!(FEW <= SlotMask::BITS as usize);

/// The slots below slot `p` (`p` up to [`FEW`]).
#[inline(always)]
fn slots_below(p: usize) -> SlotMask {
    ((1u16 << p) - 1) as SlotMask
}

impl Default for Few {
    fn default() -> Self {
        Few {
            ids: [u16::MAX; FEW],
            full: 0,
            classes: Vec::new(),
        }
    }
}

// Class indices fit the compact form's `u16`s, below its `u16::MAX` marker.
const _: () = assert!(FL_COUNT * SL_COUNT < u16::MAX as usize);

impl Few {
    /// The number of kept classes below flat class `c`: the slot of `c`, or
    /// where it would go.
    #[inline(always)]
    fn slot(&self, c: usize) -> usize {
        let c = c as u16;
        // All eight compared, no branch on the data (vectorized).
        self.ids.iter().map(|&x| usize::from(x < c)).sum()
    }

    /// The slot of class `c` if it is kept.
    #[inline(always)]
    fn kept(&self, c: usize) -> Option<usize> {
        let p = self.slot(c);
        (self.ids.get(p) == Some(&(c as u16))).then_some(p)
    }

    /// The first slot at or above `p` whose class holds a block.
    #[inline(always)]
    fn full_from(&self, p: usize) -> Option<usize> {
        let above = self.full & SlotMask::MAX.checked_shl(p as u32).unwrap_or(0);
        (above != 0).then(|| above.trailing_zeros() as usize)
    }

    /// Files `e` in class `c`; false (and nothing filed) if the class is new
    /// and every slot holds a class with blocks.
    #[inline]
    fn insert(&mut self, c: usize, e: Entry) -> bool {
        let p = self.slot(c);
        if self.ids.get(p) == Some(&(c as u16)) {
            let inserted = self.classes[p].insert(e);
            debug_assert!(inserted, "block inserted twice");
            self.full |= 1 << p;
            return true;
        }
        self.open(p, c, e)
    }

    /// [`Few::insert`] of a class not kept, at slot `p`: the slot of an empty
    /// class is given up for it if every slot is taken. (Giving one up
    /// whenever there is one would make a malloc and free pair, whose two
    /// classes empty in turn, move records at every call.)
    #[cold]
    #[inline(never)]
    fn open(&mut self, mut p: usize, c: usize, e: Entry) -> bool {
        if self.classes.len() == FEW {
            let empty = !self.full & slots_below(FEW);
            if empty == 0 {
                return false;
            }
            // The empty slot nearest below `p`, else the first above it.
            let below = empty & slots_below(p);
            let q = if below != 0 {
                (SlotMask::BITS - 1 - below.leading_zeros()) as usize
            } else {
                empty.trailing_zeros() as usize
            };
            self.close(q);
            if q < p {
                p -= 1;
            }
        }
        let n = self.classes.len();
        self.ids.copy_within(p..n, p + 1);
        self.ids[p] = c as u16;
        let mut class = Class::default();
        class.insert(e);
        // One record more, not double: a pool of one block holds one record.
        self.classes.reserve_exact(1);
        self.classes.insert(p, class);
        let low = self.full & slots_below(p);
        self.full = low | (1 << p) | ((self.full & !slots_below(p)) << 1);
        true
    }

    /// Drops slot `q`, whose class is empty.
    fn close(&mut self, q: usize) {
        debug_assert!(self.classes[q].is_empty() && self.full & (1 << q) == 0);
        let n = self.classes.len();
        self.ids.copy_within(q + 1..n, q);
        self.ids[n - 1] = u16::MAX;
        self.classes.remove(q);
        let low = self.full & slots_below(q);
        self.full = low | ((self.full >> 1) & !slots_below(q));
    }

    #[inline]
    fn remove(&mut self, c: usize, e: &Entry) -> bool {
        let Some(p) = self.kept(c) else {
            return false;
        };
        if !self.classes[p].remove(e) {
            return false;
        }
        if self.classes[p].is_empty() {
            self.full &= !(1 << p);
        }
        true
    }

    #[inline(always)]
    fn find(&self, c: usize, size: u64) -> Option<Found> {
        let mut p = self.slot(c);
        if self.ids.get(p) == Some(&(c as u16)) {
            if let Some((index, entry)) = self.classes[p].first_at_least(size) {
                return Some(Found::new(p, c, index, entry));
            }
            p += 1;
        }
        // Every block of a higher class is larger than every block of this one.
        let p = self.full_from(p)?;
        Some(Found::new(
            p,
            usize::from(self.ids[p]),
            0,
            self.classes[p].first_entry(),
        ))
    }

    #[inline]
    fn take(&mut self, f: Found) {
        let p = f.at as usize;
        self.classes[p].take(f.index as usize, &f.entry);
        if self.classes[p].is_empty() {
            self.full &= !(1 << p);
        }
    }
}

/// The table form: two levels of bitmaps over the classes, and the rows of
/// classes of the first-level classes that have held blocks.
#[derive(Debug)]
struct Table {
    fl_bitmap: u64,
    sl_bitmap: [SlMap; FL_COUNT],
    /// Per first-level class: where its row of [`SL_COUNT`] classes starts
    /// in `classes`, or [`NO_ROW`].
    rows: [u32; FL_COUNT],
    /// The rows, in the order of their first-level classes (so that the
    /// classes lie in class order, as in a full table, without the rows
    /// that never held a block).
    classes: Rows,
}

impl Table {
    fn new() -> Box<Self> {
        Box::new(Table {
            fl_bitmap: 0,
            sl_bitmap: [0; FL_COUNT],
            rows: [NO_ROW; FL_COUNT],
            classes: Rows::default(),
        })
    }

    /// Where class (fl, sl) lies in `classes` (its row exists).
    #[inline(always)]
    fn at(&self, fl: usize, sl: usize) -> usize {
        self.rows[fl] as usize + sl
    }

    /// The row of first-level class `fl`, made if it has none.
    #[inline(always)]
    fn row(&mut self, fl: usize) -> u32 {
        match self.rows[fl] {
            NO_ROW => self.add_row(fl),
            row => row,
        }
    }

    /// Makes the row of first-level class `fl`, in its place among the rows.
    #[cold]
    #[inline(never)]
    fn add_row(&mut self, fl: usize) -> u32 {
        let below = self.rows[..fl].iter().filter(|&&r| r != NO_ROW).count();
        let row = (below * SL_COUNT) as u32;
        self.classes.insert_row(below);
        for r in self.rows[fl + 1..].iter_mut().filter(|r| **r != NO_ROW) {
            *r += SL_COUNT as u32;
        }
        self.rows[fl] = row;
        row
    }

    /// Class (fl, sl), if its row exists.
    #[inline(always)]
    fn class(&self, fl: usize, sl: usize) -> Option<&Class> {
        (self.rows[fl] != NO_ROW).then(|| &self.classes[self.at(fl, sl)])
    }

    /// The class at flat index `c` (its row exists).
    #[inline(always)]
    fn class_flat(&self, c: usize) -> &Class {
        &self.classes[self.at(c / SL_COUNT, c % SL_COUNT)]
    }

    #[inline]
    fn insert(&mut self, fl: usize, sl: usize, e: Entry) {
        let at = self.row(fl) as usize + sl;
        let inserted = self.classes[at].insert(e);
        debug_assert!(inserted, "block inserted twice");
        self.fl_bitmap |= 1 << fl;
        self.sl_bitmap[fl] |= 1 << sl;
    }

    /// Class (fl, sl) became empty.
    #[inline(always)]
    fn emptied(&mut self, fl: usize, sl: usize) {
        self.sl_bitmap[fl] &= !(1 << sl);
        if self.sl_bitmap[fl] == 0 {
            self.fl_bitmap &= !(1 << fl);
        }
    }

    #[inline]
    fn remove(&mut self, fl: usize, sl: usize, e: &Entry) -> bool {
        if self.rows[fl] == NO_ROW {
            return false;
        }
        let at = self.at(fl, sl);
        let class = &mut self.classes[at];
        if !class.remove(e) {
            return false;
        }
        if class.is_empty() {
            self.emptied(fl, sl);
        }
        true
    }

    #[inline(always)]
    fn find(&self, fl: usize, sl: usize, size: u64) -> Option<Found> {
        if self.sl_bitmap[fl] & (1 << sl) != 0 {
            let at = self.at(fl, sl);
            if let Some((index, entry)) = self.classes[at].first_at_least(size) {
                return Some(Found::new(at, flat(fl, sl), index, entry));
            }
        }
        // Every block of a higher class is larger than every block of this one.
        let above_sl = self.sl_bitmap[fl] & (SlMap::MAX.checked_shl(sl as u32 + 1).unwrap_or(0));
        let (fl, sl) = if above_sl != 0 {
            (fl, above_sl.trailing_zeros() as usize)
        } else {
            let above_fl = self.fl_bitmap & u64::MAX.checked_shl(fl as u32 + 1).unwrap_or(0);
            if above_fl == 0 {
                return None;
            }
            let fl = above_fl.trailing_zeros() as usize;
            (fl, self.sl_bitmap[fl].trailing_zeros() as usize)
        };
        let at = self.at(fl, sl);
        let entry = self.classes[at].first()?;
        Some(Found::new(at, flat(fl, sl), 0, entry))
    }

    #[inline]
    fn take(&mut self, f: Found) {
        let c = &mut self.classes[f.at as usize];
        c.take(f.index as usize, &f.entry);
        if c.is_empty() {
            let class = f.class as usize;
            self.emptied(class / SL_COUNT, class % SL_COUNT);
        }
    }

    fn largest(&self) -> Option<Entry> {
        if self.fl_bitmap == 0 {
            return None;
        }
        let fl = 63 - self.fl_bitmap.leading_zeros() as usize;
        let sl = (SlMap::BITS - 1 - self.sl_bitmap[fl].leading_zeros()) as usize;
        self.classes[self.at(fl, sl)].last()
    }

    /// The first class at or above flat index `class` that holds a block.
    #[inline]
    fn nonempty_from(&self, class: usize) -> Option<usize> {
        let (fl, sl) = (class / SL_COUNT, class % SL_COUNT);
        if fl >= FL_COUNT {
            return None;
        }
        let here = self.sl_bitmap[fl] & SlMap::MAX.checked_shl(sl as u32).unwrap_or(0);
        if here != 0 {
            return Some(flat(fl, here.trailing_zeros() as usize));
        }
        let above = self.fl_bitmap & u64::MAX.checked_shl(fl as u32 + 1).unwrap_or(0);
        if above == 0 {
            return None;
        }
        let fl = above.trailing_zeros() as usize;
        Some(flat(fl, self.sl_bitmap[fl].trailing_zeros() as usize))
    }
}

/// The class records of either form, in class order.
enum Classes<'a> {
    Few(std::slice::Iter<'a, Class>),
    Table(std::iter::Flatten<std::slice::Iter<'a, Row>>),
}

impl<'a> Iterator for Classes<'a> {
    type Item = &'a Class;
    fn next(&mut self) -> Option<&'a Class> {
        match self {
            Classes::Few(it) => it.next(),
            Classes::Table(it) => it.next(),
        }
    }
}

impl DoubleEndedIterator for Classes<'_> {
    fn next_back(&mut self) -> Option<Self::Item> {
        match self {
            Classes::Few(it) => it.next_back(),
            Classes::Table(it) => it.next_back(),
        }
    }
}

/// The (first, second) level class of a size (a multiple of 512).
#[inline]
fn class_of(size: u64) -> (usize, usize) {
    let units = (size / MIN_BLOCK).max(1);
    let fl = 63 - units.leading_zeros();
    // The SL_BITS bits below the leading one, without a branch on which
    // side of it they lie (`units` < 2^55, so the shift cannot overflow).
    let sl = ((units << SL_BITS) >> fl) as usize;
    ((fl as usize).min(FL_COUNT - 1), sl & (SL_COUNT - 1))
}

#[inline]
fn flat(fl: usize, sl: usize) -> usize {
    fl * SL_COUNT + sl
}

impl Bins {
    /// Number of free blocks.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Sum of the sizes of the free blocks.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Class records the bins hold (32 bytes each): the classes that hold
    /// blocks in the compact form, 64 per row in the table form.
    #[cfg(test)]
    pub fn class_records(&self) -> usize {
        match &self.form {
            Form::Few(f) => f.classes.capacity(),
            Form::Table(t) => t.classes.capacity(),
        }
    }

    /// Host bytes the bins take, their entries beyond each class's first
    /// not counted: the record, the table's header, the class records.
    #[cfg(test)]
    pub fn host_bytes(&self) -> usize {
        let header = match &self.form {
            Form::Few(_) => 0,
            Form::Table(_) => std::mem::size_of::<Table>(),
        };
        std::mem::size_of::<Self>() + header + self.class_records() * std::mem::size_of::<Class>()
    }

    /// Whether the bins are in the compact form (Note [Bins sized by use]).
    #[cfg(test)]
    pub fn is_compact(&self) -> bool {
        matches!(self.form, Form::Few(_))
    }

    /// Empty bins in the table form from the start (tests compare the forms).
    #[cfg(test)]
    fn table() -> Self {
        Bins {
            form: Form::Table(Table::new()),
            len: 0,
            bytes: 0,
        }
    }

    #[inline]
    pub fn insert(&mut self, size: u64, addr: u64, id: BlockId) {
        let (fl, sl) = class_of(size);
        let e = Entry { size, addr, id };
        match &mut self.form {
            Form::Table(t) => t.insert(fl, sl, e),
            Form::Few(f) => {
                if !f.insert(flat(fl, sl), e) {
                    self.make_table().insert(fl, sl, e);
                }
            }
        }
        self.len += 1;
        self.bytes += size;
    }

    /// The compact form outgrew [`FEW`] classes: its classes move to a table.
    #[cold]
    #[inline(never)]
    fn make_table(&mut self) -> &mut Table {
        let mut t = Table::new();
        if let Form::Few(f) = &mut self.form {
            let full = f.full;
            let classes = std::mem::take(&mut f.classes).into_iter().enumerate();
            for (&c, (_, class)) in f
                .ids
                .iter()
                .zip(classes)
                .filter(|(_, (p, _))| full & 1 << p != 0)
            {
                let (fl, sl) = (usize::from(c) / SL_COUNT, usize::from(c) % SL_COUNT);
                let at = t.row(fl) as usize + sl;
                t.classes[at] = class;
                t.fl_bitmap |= 1 << fl;
                t.sl_bitmap[fl] |= 1 << sl;
            }
        }
        self.form = Form::Table(t);
        match &mut self.form {
            Form::Table(t) => t,
            Form::Few(_) => unreachable!("just made a table"),
        }
    }

    /// Whether the entry is filed (for consistency checks: one class lookup,
    /// not a walk over every entry).
    pub fn contains(&self, size: u64, addr: u64, id: BlockId) -> bool {
        let (fl, sl) = class_of(size);
        let e = Entry { size, addr, id };
        match &self.form {
            Form::Few(f) => f
                .kept(flat(fl, sl))
                .is_some_and(|p| f.classes[p].contains(&e)),
            Form::Table(t) => t.class(fl, sl).is_some_and(|c| c.contains(&e)),
        }
    }

    /// Removes a block; returns false if it was not there.
    #[inline]
    pub fn remove(&mut self, size: u64, addr: u64, id: BlockId) -> bool {
        let (fl, sl) = class_of(size);
        let e = Entry { size, addr, id };
        let removed = match &mut self.form {
            Form::Table(t) => t.remove(fl, sl, &e),
            Form::Few(f) => f.remove(flat(fl, sl), &e),
        };
        if removed {
            self.len -= 1;
            self.bytes -= size;
        }
        removed
    }

    /// The smallest free block of at least `size` bytes, lowest address on ties.
    #[inline]
    pub fn best_fit(&self, size: u64) -> Option<Entry> {
        self.find(size).map(|f| f.entry)
    }

    /// [`Bins::best_fit`], with where the entry lies, for [`Bins::take`].
    /// Always inlined: returned through memory, the answer costs a
    /// store-forwarding stall when the caller reads it back.
    #[inline(always)]
    pub fn find(&self, size: u64) -> Option<Found> {
        let (fl, sl) = class_of(size);
        match &self.form {
            Form::Table(t) => t.find(fl, sl, size),
            Form::Few(f) => f.find(flat(fl, sl), size),
        }
    }

    /// Removes an entry [`Bins::find`] returned (the bins unchanged since),
    /// without searching for it again.
    #[inline]
    pub fn take(&mut self, f: Found) {
        match &mut self.form {
            Form::Table(t) => t.take(f),
            Form::Few(few) => few.take(f),
        }
        self.len -= 1;
        self.bytes -= f.entry.size;
    }

    /// The largest free block (highest address among equals).
    pub fn largest(&self) -> Option<Entry> {
        match &self.form {
            Form::Few(f) => {
                let p = (SlotMask::BITS - 1).checked_sub(f.full.leading_zeros())?;
                f.classes[p as usize].last()
            }
            Form::Table(t) => t.largest(),
        }
    }

    /// The free blocks of at least `size` bytes, ascending by (size,
    /// address): [`Bins::best_fit`] first.
    pub fn iter_from(&self, size: u64) -> impl Iterator<Item = Entry> + '_ {
        let (fl, sl) = class_of(size);
        // Classes that hold blocks only (in the table, found through the
        // bitmaps: walking every class above the size cost more than the
        // near fits it served).
        std::iter::successors(self.first_at(flat(fl, sl)), move |&p| self.next_at(p))
            .flat_map(move |p| self.class_at(p).iter())
            .filter(move |e| e.size >= size)
    }

    /// The free blocks of `lo` to `hi` bytes, ascending by (size, address):
    /// [`Bins::iter_from`] up to the first block above `hi`, which the walk
    /// stops before without reading a class above `hi`'s (in the compact
    /// form, the class indices in the bins' own record tell).
    pub fn iter_between(&self, lo: u64, hi: u64) -> impl Iterator<Item = Entry> + '_ {
        let (fl, sl) = class_of(lo);
        let (hfl, hsl) = class_of(hi.max(lo));
        let last = flat(hfl, hsl);
        // Every block of a class above `last` is above `hi` (classes are monotonic).
        std::iter::successors(self.first_at(flat(fl, sl)), move |&p| self.next_at(p))
            .take_while(move |&p| self.class_index_at(p) <= last)
            .flat_map(move |p| self.class_at(p).iter())
            .filter(move |e| e.size >= lo)
            .take_while(move |e| e.size <= hi)
    }

    /// The flat class index of place `p` ([`Bins::first_at`]).
    #[inline]
    fn class_index_at(&self, p: usize) -> usize {
        match &self.form {
            Form::Few(f) => usize::from(f.ids[p]),
            Form::Table(_) => p,
        }
    }

    /// The first class at or above flat class `c` that holds a block, as a
    /// place for [`Bins::class_at`]: a slot of the compact form, a flat
    /// class of the table.
    #[inline]
    fn first_at(&self, c: usize) -> Option<usize> {
        match &self.form {
            Form::Few(f) => f.full_from(f.slot(c)),
            Form::Table(t) => t.nonempty_from(c),
        }
    }

    /// The place after `p` ([`Bins::first_at`]) that holds a block.
    #[inline]
    fn next_at(&self, p: usize) -> Option<usize> {
        match &self.form {
            Form::Few(f) => f.full_from(p + 1),
            Form::Table(t) => t.nonempty_from(p + 1),
        }
    }

    #[inline]
    fn class_at(&self, p: usize) -> &Class {
        match &self.form {
            Form::Few(f) => &f.classes[p],
            Form::Table(t) => t.class_flat(p),
        }
    }

    /// All free blocks, ascending by (size, address).
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = Entry> + '_ {
        // Either form keeps its classes in class order.
        let classes = match &self.form {
            Form::Few(f) => Classes::Few(f.classes.iter()),
            Form::Table(t) => Classes::Table(t.classes.iter()),
        };
        classes.flat_map(Class::iter)
    }
}

#[cfg(test)]
mod tests;

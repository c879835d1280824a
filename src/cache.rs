//! The plan caches: a map from a plan's key to its built value, where each key is built once.
//!
//! A build (planning, lowering, checking, uploading) runs outside the map's lock, so calls whose plan
//! is there, or whose key another thread is building, never wait for an unrelated build. Calls that
//! miss the same key at once wait for the first one's build instead of each building (and uploading)
//! a copy. A build that fails (or unwinds) caches nothing and wakes its waiters, one of which builds
//! again: each call gets its own error, since it may depend on the caller (a capturing stream).

use crate::error::Result;
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Condvar, Mutex, MutexGuard};

/// A key's state in the map.
enum Slot<V> {
    Ready(V),
    /// One call is building the value; others wait on [`BuildOnce::built`].
    Building,
}

/// A map whose values are built once per key (see the module documentation).
pub(crate) struct BuildOnce<K, V> {
    map: Mutex<HashMap<K, Slot<V>>>,
    /// Signalled whenever a build ends, with a value or without.
    built: Condvar,
}

impl<K: Hash + Eq + Clone, V: Clone> BuildOnce<K, V> {
    pub(crate) fn new() -> Self {
        BuildOnce { map: Mutex::new(HashMap::new()), built: Condvar::new() }
    }

    /// The lock, also after a panic elsewhere: every update leaves the map consistent.
    fn lock(&self) -> MutexGuard<'_, HashMap<K, Slot<V>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The value for `key`, or the one `build` makes (and whether this call built it). A call that
    /// finds `key` being built waits for that build; a build that fails leaves the key unbuilt.
    pub(crate) fn get_or_build(&self, key: K, build: impl FnOnce() -> Result<V>) -> Result<(V, bool)> {
        let mut map = self.lock();
        loop {
            match map.get(&key) {
                Some(Slot::Ready(v)) => return Ok((v.clone(), false)),
                Some(Slot::Building) => map = self.built.wait(map).unwrap_or_else(|e| e.into_inner()),
                None => break,
            }
        }
        map.insert(key.clone(), Slot::Building);
        drop(map);
        // Takes the marker out again unless the value replaced it, also when `build` unwinds.
        let mut pending = Pending { cache: self, key: Some(key) };
        let value = build()?;
        let key = pending.key.take().expect("taken only here");
        self.lock().insert(key, Slot::Ready(value.clone()));
        self.built.notify_all();
        Ok((value, true))
    }

    /// The number of built values.
    pub(crate) fn len(&self) -> usize {
        self.lock().values().filter(|s| matches!(s, Slot::Ready(_))).count()
    }

    /// The number of built values, or `None` while another thread holds the map (for `Debug`, which
    /// must not wait).
    pub(crate) fn try_len(&self) -> Option<usize> {
        let map = self.map.try_lock().ok()?;
        Some(map.values().filter(|s| matches!(s, Slot::Ready(_))).count())
    }

    /// Drops every built value. Builds in progress go on and insert their values when done (a plan
    /// depends only on its key and the communicator, so it is as good as one built after the clear);
    /// their waiters keep waiting for them.
    pub(crate) fn clear(&self) {
        self.lock().retain(|_, s| matches!(s, Slot::Building));
    }
}

/// A build in progress: dropped before its value is inserted (an error or a panic in the build), it
/// removes the key's marker and wakes the waiters.
struct Pending<'a, K: Hash + Eq + Clone, V: Clone> {
    cache: &'a BuildOnce<K, V>,
    key: Option<K>,
}

impl<K: Hash + Eq + Clone, V: Clone> Drop for Pending<'_, K, V> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            let mut map = self.cache.lock();
            if matches!(map.get(&key), Some(Slot::Building)) {
                map.remove(&key);
            }
            drop(map);
            self.cache.built.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use std::sync::mpsc;
    use std::time::Duration;

    /// A bounded wait: a build that the test holds up must not hang the suite when an assertion fails.
    const HOLD: Duration = Duration::from_secs(10);

    /// A built value is returned without building; a failed build caches nothing.
    #[test]
    fn a_value_is_built_once_and_a_failure_caches_nothing() {
        let cache: BuildOnce<u32, u32> = BuildOnce::new();
        assert_eq!(cache.get_or_build(1, || Ok(10)).unwrap(), (10, true));
        assert_eq!(cache.get_or_build(1, || panic!("built again")).unwrap(), (10, false));
        assert!(matches!(cache.get_or_build(2, || Err(Error::Poisoned)), Err(Error::Poisoned)));
        assert_eq!(cache.len(), 1, "a failed build was cached");
        assert_eq!(cache.get_or_build(2, || Ok(20)).unwrap(), (20, true), "the failed key was left marked");
        assert_eq!(cache.try_len(), Some(2));
        cache.clear();
        assert_eq!(cache.len(), 0);
        assert_eq!(cache.get_or_build(1, || Ok(11)).unwrap(), (11, true), "the clear kept a value");
    }

    /// While one call builds a key: another key's lookup and build do not wait for it, a second call
    /// for the same key waits and gets the first call's value without building, and a clear meanwhile
    /// keeps the build's value.
    #[test]
    fn calls_for_a_key_being_built_wait_for_that_build() {
        let cache: BuildOnce<u32, u32> = BuildOnce::new();
        cache.get_or_build(1, || Ok(10)).unwrap();
        let (started, wait_started) = mpsc::channel();
        let (finish, wait_finish) = mpsc::channel::<()>();
        let (second_done, wait_second) = mpsc::channel();
        std::thread::scope(|scope| {
            // Moved in, so that a failed assertion below drops it and the builder stops waiting.
            let finish = finish;
            let cache = &cache;
            let slow = scope.spawn(move || {
                cache.get_or_build(3, || {
                    started.send(()).unwrap();
                    let _ = wait_finish.recv_timeout(HOLD);
                    Ok(30)
                })
            });
            wait_started.recv().unwrap();
            let second = scope.spawn(move || {
                let r = cache.get_or_build(3, || panic!("built while another call was building it"));
                second_done.send(()).unwrap();
                r
            });
            // Key 1 comes from the map and key 2 is built while key 3's build is in progress.
            assert_eq!(cache.get_or_build(1, || panic!("built again")).unwrap(), (10, false));
            assert_eq!(cache.get_or_build(2, || Ok(20)).unwrap(), (20, true));
            assert!(
                wait_second.recv_timeout(Duration::from_millis(200)).is_err(),
                "the second call for key 3 returned before its build ended"
            );
            cache.clear();
            finish.send(()).unwrap();
            assert_eq!(slow.join().unwrap().unwrap(), (30, true));
            assert_eq!(second.join().unwrap().unwrap(), (30, false));
        });
        assert_eq!(cache.len(), 1, "only key 3's value, built across the clear, is kept");
    }

    /// A build that fails or panics wakes the calls waiting for it, and one of them builds the key.
    #[test]
    fn a_failed_or_panicking_build_wakes_its_waiters() {
        for panics in [false, true] {
            let cache: BuildOnce<u32, u32> = BuildOnce::new();
            let (started, wait_started) = mpsc::channel();
            let (finish, wait_finish) = mpsc::channel::<()>();
            std::thread::scope(|scope| {
                let finish = finish;
                let cache = &cache;
                let failing = scope.spawn(move || {
                    cache.get_or_build(5, || {
                        started.send(()).unwrap();
                        let _ = wait_finish.recv_timeout(HOLD);
                        if panics {
                            panic!("the build panics");
                        }
                        Err(Error::Poisoned)
                    })
                });
                wait_started.recv().unwrap();
                let waiter = scope.spawn(move || cache.get_or_build(5, || Ok(50)));
                // Give the waiter time to find the key being built (it builds the key either way).
                std::thread::sleep(Duration::from_millis(50));
                finish.send(()).unwrap();
                match failing.join() {
                    Ok(r) => assert!(!panics && matches!(r, Err(Error::Poisoned))),
                    Err(_) => assert!(panics, "the build panicked unasked"),
                }
                assert_eq!(waiter.join().unwrap().unwrap(), (50, true));
            });
            assert_eq!(cache.len(), 1);
        }
    }
}

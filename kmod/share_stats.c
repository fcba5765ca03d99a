// SPDX-License-Identifier: GPL-2.0
/*
 * BUNSHIN_IOC_SHARE_STATS: walk the page tables of a set of mms and count
 * the physical pages each maps, and how many of them the others map too.
 * BUNSHIN_IOC_GROUP_STATS: the same walk where a member is a group of mms.
 * The counting rules are in include/uapi/linux/bunshin.h.
 */
#define pr_fmt(fmt) "bunshin: share_stats: " fmt

#include <linux/bitmap.h>
#include <linux/capability.h>
#include <linux/hugetlb.h>
#include <linux/huge_mm.h>
#include <linux/mm.h>
#include <linux/moduleparam.h>
#include <linux/mutex.h>
#include <linux/pagewalk.h>
#include <linux/ptrace.h>
#include <linux/sched/signal.h>
#include <linux/slab.h>
#include <linux/sizes.h>
#include <linux/sort.h>
#include <linux/uaccess.h>
#include <linux/xarray.h>
#include <linux/bunshin.h>

#include "verbs.h"
#include "ksyms.h"
#include "refs.h"

/* One distinct mm of the set. */
struct share_member {
	struct mm_struct *mm;
	u64 mapped;	/* page-table entries counted */
	u32 tag;	/* its group (SHARE_STATS: its own index) */
};

/* What pages are counted per: an mm (SHARE_STATS) or a group (GROUP_STATS). */
struct share_tag {
	u64 distinct;	/* distinct pfns */
	u64 unique;	/* distinct pfns no other tag maps */
};

/*
 * pfns: pfn -> xa_mk_value(last_tag << 2 | n), n = 1 for one tag, 2 for two
 * or more.  Members are walked one after another, those of one tag
 * consecutively, so a pfn whose last tag is the one being walked was already
 * seen in this tag: that is how a page mapped twice stays one distinct
 * page of its mm or group.  The map grows
 * with the distinct pages of the set (a dense pfn range costs ~9 bytes per
 * page), is charged to the caller's memcg and freed before returning.
 *
 * dense: the same values in a plain array indexed by pfn (0: not seen), used
 * instead when an array over all of RAM is small next to the work (see
 * share_pick_dense()): one load and one store per page, no lock, no tree.
 * A pfn beyond it (memory hot-added since) goes to the xarray.  chunks has a
 * bit per SHARE_CHUNK pfns of it that the call set, so that only those are
 * zeroed for the next call (the array is kept between calls, see
 * share_cache).
 */
struct share_state {
	struct xarray pfns;
	struct share_member *members;
	struct share_tag *tags;
	u32 nmembers;
	u32 ntags;
	u32 cur;		/* member being walked */
	u32 *slot_of;		/* pids[i] -> member index */
	u32 *first_pid_of;	/* member -> lowest i with that mm */
	u16 *dense;
	unsigned long ndense;
	unsigned long *chunks;
	bool dense_cached;	/* dense is share_cache's */
	u64 total;		/* distinct pfns of the whole set */
	u64 shared;		/* of those, mapped by two tags or more */
	unsigned long buf[PTRS_PER_PTE];	/* pfns read under one pte lock */
};

#define SHARE_MULTI 2UL

/* Between batches: a long walk must stay killable and let others run. */
static int share_yield(void)
{
	if (fatal_signal_pending(current))
		return -EINTR;
	cond_resched();
	return 0;
}

/*
 * A pfn the current tag sees for the first time, whose entry was @old (0: no
 * tag saw it yet).  Counting as the walk goes, rather than over the whole map
 * afterwards, spares a pass over every pfn of RAM (the dense array) or every
 * distinct page (the xarray).
 */
static void share_account(struct share_state *st, struct share_tag *t, unsigned long old)
{
	t->distinct++;
	if (!old) {
		t->unique++;
		st->total++;
	} else if ((old & 3) != SHARE_MULTI) {
		st->tags[old >> 2].unique--;	/* its only tag so far: shared now */
		st->shared++;
	}
}

/*
 * Note @n pfns of the member being walked: @pfns[i], or @first + i when @pfns
 * is NULL (a huge page).  One xarray lock per batch, and consecutive pfns
 * step to the next slot instead of walking down from the root again; nodes
 * are allocated outside the lock (xas_nomem) and the batch resumes where it
 * stopped.
 */
static int share_note_xa(struct share_state *st, const unsigned long *pfns,
			 unsigned long first, unsigned int n)
{
	struct share_member *m = &st->members[st->cur];
	struct share_tag *t = &st->tags[m->tag];
	unsigned long tagv = (unsigned long)m->tag << 2;
	XA_STATE(xas, &st->pfns, 0);
	unsigned int i = 0;

	do {
		bool placed = false;	/* xas sits on the slot of the previous pfn */

		xas_lock(&xas);
		for (; i < n; i++) {
			unsigned long pfn = pfns ? pfns[i] : first + i;
			unsigned long v;
			void *old;

			if (placed && pfn == xas.xa_index + 1) {
				old = xas_next(&xas);
			} else {
				xas_set(&xas, pfn);
				old = xas_load(&xas);
			}
			placed = true;
			if (!old) {
				v = tagv | 1;
			} else if ((xa_to_value(old) >> 2) == m->tag) {
				m->mapped++;	/* seen in this mm or group already */
				continue;
			} else {
				v = tagv | SHARE_MULTI;
			}
			xas_store(&xas, xa_mk_value(v));
			if (xas_error(&xas))
				break;	/* no node: allocate unlocked, then resume at i */
			m->mapped++;
			share_account(st, t, old ? xa_to_value(old) : 0);
		}
		xas_unlock(&xas);
	} while (xas_nomem(&xas, GFP_KERNEL_ACCOUNT));
	return xas_error(&xas);
}

#define SHARE_CHUNK_SHIFT 10
#define SHARE_CHUNK (1UL << SHARE_CHUNK_SHIFT)

/*
 * What noting a run of pages with the dense array adds up, kept in locals and
 * added to st once per run: the kernel is built with -fno-strict-aliasing, so
 * counters in *st would be reloaded and stored again around every store to
 * the array.
 */
struct share_dense_run {
	u16 *dense;
	unsigned long *chunks;
	struct share_tag *tags;
	u16 tag;
	u64 mapped, distinct, fresh, shared;
};

static void share_run_begin(struct share_state *st, struct share_dense_run *r)
{
	r->dense = st->dense;
	r->chunks = st->chunks;
	r->tags = st->tags;
	r->tag = st->members[st->cur].tag;
	r->mapped = r->distinct = r->fresh = r->shared = 0;
}

/* The rules of share_account(), for a pfn below st->ndense: loads and stores only, so it
 * may run under the pte lock (no copy of the table to a buffer first). */
static __always_inline void share_note_dense(struct share_dense_run *r, unsigned long pfn)
{
	u16 old = r->dense[pfn];

	r->mapped++;
	if (old && old >> 2 == r->tag)
		return;
	r->dense[pfn] = r->tag << 2 | (old ? SHARE_MULTI : 1);
	r->distinct++;
	if (!old) {
		r->fresh++;
		__set_bit(pfn >> SHARE_CHUNK_SHIFT, r->chunks);
	} else if ((old & 3) != SHARE_MULTI) {
		r->tags[old >> 2].unique--;	/* another tag's: its walk is over */
		r->shared++;
	}
}

static void share_run_end(struct share_state *st, const struct share_dense_run *r)
{
	struct share_member *m = &st->members[st->cur];
	struct share_tag *t = &st->tags[m->tag];

	m->mapped += r->mapped;
	t->distinct += r->distinct;
	t->unique += r->fresh;
	st->total += r->fresh;
	st->shared += r->shared;
}

static int share_note_many(struct share_state *st, const unsigned long *pfns,
			   unsigned long first, unsigned int n)
{
	struct share_dense_run r;
	unsigned int i;
	int err = 0;

	if (!st->dense) {
		err = share_note_xa(st, pfns, first, n);
		return err ? err : share_yield();
	}
	share_run_begin(st, &r);
	for (i = 0; i < n && !err; i++) {
		unsigned long pfn = pfns ? pfns[i] : first + i;

		if (likely(pfn < st->ndense))
			share_note_dense(&r, pfn);
		else
			err = share_note_xa(st, &pfn, 0, 1);
	}
	share_run_end(st, &r);
	return err ? err : share_yield();
}

/* A huge page: in batches, so the lock is never held for more than a pte table's worth. */
static int share_note_run(struct share_state *st, unsigned long pfn,
			  unsigned long n)
{
	while (n) {
		unsigned int k = min_t(unsigned long, n, PTRS_PER_PTE);
		int err = share_note_many(st, NULL, pfn, k);

		if (err)
			return err;
		pfn += k;
		n -= k;
	}
	return 0;
}

static int share_note_buf(struct share_state *st, unsigned int n)
{
	return share_note_many(st, st->buf, 0, n);
}

/* pmd_trans_huge_lock() from huge_mm.h, calling the resolved symbol. */
static spinlock_t *share_pmd_huge_lock(pmd_t *pmd, struct vm_area_struct *vma)
{
	pmd_t pmdval = READ_ONCE(*pmd);

	if (is_swap_pmd(pmdval) || pmd_trans_huge(pmdval) || pmd_devmap(pmdval))
		return bunshin_ks.__pmd_trans_huge_lock(pmd, vma);
	return NULL;
}

/*
 * With the dense array a pte is noted right under the page-table lock (a load
 * and a store).  For the xarray entries are copied out under the lock and
 * noted after it is dropped, because noting allocates and may sleep.  Only
 * pfn numbers are kept, never page pointers, so a page freed meanwhile is
 * harmless.
 */
static int share_pmd_entry(pmd_t *pmd, unsigned long addr, unsigned long end,
			   struct mm_walk *walk)
{
	struct share_state *st = walk->private;
	unsigned int n = 0;
	spinlock_t *ptl;
	pte_t *start, *pte;
	pmd_t pmdval;

	ptl = share_pmd_huge_lock(pmd, walk->vma);
	if (ptl) {
		unsigned long first = 0;
		bool present;

		pmdval = *pmd;
		present = pmd_present(pmdval) &&
			  pmd_pfn(pmdval) != READ_ONCE(*bunshin_ks.huge_zero_pfn);
		if (present)
			first = pmd_pfn(pmdval) + ((addr & ~PMD_MASK) >> PAGE_SHIFT);
		spin_unlock(ptl);
		if (!present)
			return 0;
		return share_note_run(st, first, (end - addr) >> PAGE_SHIFT);
	}

	/* pmd_trans_unstable() would clear a bad pmd via the unexported
	 * pmd_clear_bad(); a reader has no business repairing tables, so a
	 * pmd that is not a plain table pointer is just skipped. */
	pmdval = READ_ONCE(*pmd);
	if (pmd_none(pmdval) || !pmd_present(pmdval) || pmd_trans_huge(pmdval) ||
	    pmd_devmap(pmdval) || pmd_bad(pmdval))
		return 0;

	start = pte = pte_offset_map_lock(walk->mm, pmd, addr, &ptl);
	if (st->dense) {
		/* counted in place; only pfns beyond the array (hot-added memory) wait in buf
		 * for the xarray, which allocates */
		const unsigned long ndense = st->ndense;
		struct share_dense_run r;

		share_run_begin(st, &r);
		for (; addr < end; pte++, addr += PAGE_SIZE) {
			pte_t ptent = *pte;
			unsigned long pfn = pte_pfn(ptent);

			if (!pte_present(ptent) || is_zero_pfn(pfn))
				continue;
			if (likely(pfn < ndense))
				share_note_dense(&r, pfn);
			else
				st->buf[n++] = pfn;
		}
		pte_unmap_unlock(start, ptl);
		share_run_end(st, &r);
		return n ? share_note_buf(st, n) : share_yield();
	}
	for (; addr < end; pte++, addr += PAGE_SIZE) {
		pte_t ptent = *pte;

		if (pte_present(ptent) && !is_zero_pfn(pte_pfn(ptent)))
			st->buf[n++] = pte_pfn(ptent);
	}
	pte_unmap_unlock(start, ptl);
	return share_note_buf(st, n);
}

static int share_hugetlb_entry(pte_t *ptep, unsigned long hmask,
			       unsigned long addr, unsigned long end,
			       struct mm_walk *walk)
{
	pte_t pte = huge_ptep_get(ptep);

	if (!pte_present(pte))
		return 0;
	return share_note_run(walk->private,
			      pte_pfn(pte) + ((addr & ~hmask) >> PAGE_SHIFT),
			      (end - addr) >> PAGE_SHIFT);
}

/* No test_walk: the default skips VM_PFNMAP vmas, as /proc/PID/pagemap
 * does.  No pte_entry: it would make the walker split huge pmds. */
static const struct mm_walk_ops share_walk_ops = {
	.pmd_entry = share_pmd_entry,
	.hugetlb_entry = share_hugetlb_entry,
};

static struct mm_struct *share_get_mm(pid_t nr)
{
	struct task_struct *task;
	struct mm_struct *mm;

	if (nr <= 0)
		return ERR_PTR(-EINVAL);
	task = bunshin_get_task(nr);
	if (!task)
		return ERR_PTR(-ESRCH);
	mm = bunshin_ks.mm_access(task, PTRACE_MODE_READ_FSCREDS);
	bunshin_put_task(task);
	if (!mm)
		return ERR_PTR(-ESRCH);
	if (IS_ERR(mm))
		return PTR_ERR(mm) == -EACCES ? ERR_PTR(-EPERM) : mm;
	bunshin_ref_get(BUNSHIN_REF_MM);
	return mm;
}

/*
 * Resolve every pid before walking anything, so a bad pid costs no walk.
 * @groups (GROUP_STATS) gives each pid's tag; NULL tags each mm by itself.
 */
static int share_add_pids(struct share_state *st, const s32 *pids,
			  const u32 *groups, u32 npids)
{
	u32 i, j;

	for (i = 0; i < npids; i++) {
		struct mm_struct *mm;

		if (groups && groups[i] >= st->ntags)
			return -EINVAL;
		mm = share_get_mm(pids[i]);
		if (IS_ERR(mm))
			return PTR_ERR(mm);
		for (j = 0; j < st->nmembers; j++)
			if (st->members[j].mm == mm)
				break;
		if (j < st->nmembers) {
			bunshin_put_mm(mm);
			if (groups && st->members[j].tag != groups[i])
				return -EINVAL;	/* one mm in two groups */
		} else {
			st->members[j].mm = mm;
			st->members[j].tag = groups ? groups[i] : j;
			st->first_pid_of[j] = i;
			st->nmembers++;
		}
		st->slot_of[i] = j;
	}
	if (!groups)
		st->ntags = st->nmembers;
	return 0;
}

static int share_cmp_tag(const void *a, const void *b)
{
	const struct share_member *x = a, *y = b;

	return x->tag < y->tag ? -1 : x->tag > y->tag;
}

static int share_walk(struct share_state *st)
{
	int err = 0;

	for (st->cur = 0; st->cur < st->nmembers && !err; st->cur++) {
		struct mm_struct *mm = st->members[st->cur].mm;

		if (mmap_read_lock_killable(mm))
			return -EINTR;
		err = bunshin_ks.walk_page_range(mm, 0, ULONG_MAX, &share_walk_ops, st);
		mmap_read_unlock(mm);
	}
	return err;
}

static bool share_dense = true;
module_param(share_dense, bool, 0644);
MODULE_PARM_DESC(share_dense, "count in a pfn-indexed array when it pays (N: always the xarray)");

/* Cap on the dense array: 2^27 pfns (512 GiB of RAM) make 256 MiB. */
#define SHARE_DENSE_MAX (1UL << 27)

#define SHARE_DENSE_SMALL SZ_8M

/*
 * A dense array of at most SHARE_DENSE_SMALL bytes is kept between calls,
 * with its chunk bitmap: allocating and zeroing it took 0.8 of the 1.3 ms a
 * 100-page process cost in the test guest.  One call at a time has it (the
 * lock is held from share_pick_dense() to share_free()); a concurrent call
 * allocates its own.  It is owned by the module, not charged to a caller's
 * memcg, and freed at unload or replaced when max_pfn changes.
 */
static struct {
	struct mutex lock;
	u16 *dense;
	unsigned long *chunks;
	unsigned long n;
} share_cache = { .lock = __MUTEX_INITIALIZER(share_cache.lock) };

static void share_dense_free(u16 **dense, unsigned long **chunks)
{
	kvfree(*dense);
	bitmap_free(*chunks);
	*dense = NULL;
	*chunks = NULL;
}

/* A zeroed array for @n pfns and its chunk bitmap; false, with neither held, without memory. */
static bool share_dense_alloc(unsigned long n, gfp_t gfp, u16 **dense, unsigned long **chunks)
{
	*dense = kvcalloc(n, sizeof(u16), gfp | __GFP_NOWARN);
	*chunks = bitmap_zalloc(DIV_ROUND_UP(n, SHARE_CHUNK), gfp);
	if (*dense && *chunks)
		return true;
	share_dense_free(dense, chunks);
	return false;
}

static void share_cache_drop(void)
{
	share_dense_free(&share_cache.dense, &share_cache.chunks);
	share_cache.n = 0;
}

/* With share_cache.lock held: the cached array for @n pfns, made if need be. */
static bool share_cache_take(struct share_state *st, unsigned long n)
{
	if (share_cache.n != n) {
		share_cache_drop();
		if (!share_dense_alloc(n, GFP_KERNEL, &share_cache.dense, &share_cache.chunks))
			return false;
		share_cache.n = n;
	}
	st->dense = share_cache.dense;
	st->chunks = share_cache.chunks;
	st->ndense = n;
	st->dense_cached = true;
	return true;
}

/* Zero what this call set, chunk by chunk, for the next one. */
static void share_cache_clean(struct share_state *st)
{
	unsigned long nchunks = DIV_ROUND_UP(st->ndense, SHARE_CHUNK), c;

	for_each_set_bit(c, st->chunks, nchunks) {
		unsigned long from = c << SHARE_CHUNK_SHIFT;

		memset(st->dense + from, 0,
		       min(SHARE_CHUNK, st->ndense - from) * sizeof(u16));
	}
	bitmap_zero(st->chunks, nchunks);
}

void bunshin_share_exit(void)
{
	mutex_lock(&share_cache.lock);
	share_cache_drop();
	mutex_unlock(&share_cache.lock);
}

/*
 * The dense array costs 2 bytes per pfn of RAM whatever the set maps, the
 * xarray ~9 bytes per distinct page mapped: take the array when it is at
 * most SHARE_DENSE_SMALL (machines up to 16 GiB; then it is the cached one
 * unless another call has that) or no bigger than the xarray would be.
 * Without memory for it the xarray serves.
 */
static void share_pick_dense(struct share_state *st)
{
	unsigned long n = READ_ONCE(*bunshin_ks.max_pfn), rss = 0;
	u32 i;

	if (!READ_ONCE(share_dense))
		return;
	for (i = 0; i < st->nmembers; i++)
		rss += get_mm_rss(st->members[i].mm);
	if (!n || n > SHARE_DENSE_MAX || (n * sizeof(u16) > SHARE_DENSE_SMALL && n > rss * 4))
		return;
	if (n * sizeof(u16) <= SHARE_DENSE_SMALL && mutex_trylock(&share_cache.lock)) {
		if (share_cache_take(st, n))
			return;
		mutex_unlock(&share_cache.lock);
	}
	if (share_dense_alloc(n, GFP_KERNEL_ACCOUNT, &st->dense, &st->chunks))
		st->ndense = n;
}

static int share_check(const struct bunshin_share_stats *req)
{
	size_t i;

	if (req->flags || req->stats_size != sizeof(struct bunshin_pid_stats))
		return -EINVAL;
	for (i = 0; i < ARRAY_SIZE(req->reserved); i++)
		if (req->reserved[i])
			return -EINVAL;
	if (!req->npids)
		return -EINVAL;
	if (req->npids > BUNSHIN_SHARE_STATS_MAX_PIDS)
		return -E2BIG;
	return 0;
}

static int share_copy_out(struct share_state *st, const s32 *pids, u32 npids,
		       u64 stats_ptr)
{
	struct bunshin_pid_stats *out;
	u32 i;
	int err = 0;

	out = kvcalloc(npids, sizeof(*out), GFP_KERNEL_ACCOUNT);
	if (!out)
		return -ENOMEM;
	for (i = 0; i < npids; i++) {
		const struct share_member *m = &st->members[st->slot_of[i]];
		const struct share_tag *t = &st->tags[m->tag];

		out[i].pid = pids[i];
		out[i].mm_slot = st->first_pid_of[st->slot_of[i]];
		out[i].mapped_pages = m->mapped;
		out[i].unique_pages = t->unique;
		out[i].shared_pages = t->distinct - t->unique;
	}
	if (copy_to_user(u64_to_user_ptr(stats_ptr), out, npids * sizeof(*out)))
		err = -EFAULT;
	kvfree(out);
	return err;
}

static void share_free(struct share_state *st)
{
	u32 i;

	for (i = 0; i < st->nmembers; i++)
		bunshin_put_mm(st->members[i].mm);
	xa_destroy(&st->pfns);
	if (st->dense_cached) {
		share_cache_clean(st);
		mutex_unlock(&share_cache.lock);
	} else {
		share_dense_free(&st->dense, &st->chunks);
	}
	bunshin_ref_put(BUNSHIN_REF_PFNS);
	kvfree(st->first_pid_of);
	kvfree(st->slot_of);
	kvfree(st->tags);
	kvfree(st->members);
	kfree(st);
}

static struct share_state *share_alloc(u32 npids, u32 ntags)
{
	struct share_state *st = kzalloc(sizeof(*st), GFP_KERNEL_ACCOUNT);

	if (!st)
		return NULL;
	st->ntags = ntags;
	st->members = kvcalloc(npids, sizeof(*st->members), GFP_KERNEL_ACCOUNT);
	st->tags = kvcalloc(ntags, sizeof(*st->tags), GFP_KERNEL_ACCOUNT);
	st->slot_of = kvcalloc(npids, sizeof(u32), GFP_KERNEL_ACCOUNT);
	st->first_pid_of = kvcalloc(npids, sizeof(u32), GFP_KERNEL_ACCOUNT);
	xa_init_flags(&st->pfns, XA_FLAGS_ACCOUNT);
	bunshin_ref_get(BUNSHIN_REF_PFNS);
	if (!st->members || !st->tags || !st->slot_of || !st->first_pid_of) {
		share_free(st);
		return NULL;
	}
	return st;
}

/* Resolve every pid, then walk (with @groups: one group's mms one after another, see struct
 * share_state); the counts are in @st. */
static int share_run(struct share_state *st, const s32 *pids, const u32 *groups, u32 npids)
{
	int err = share_add_pids(st, pids, groups, npids);

	if (err)
		return err;
	if (groups)
		sort(st->members, st->nmembers, sizeof(*st->members), share_cmp_tag, NULL);
	share_pick_dense(st);
	return share_walk(st);
}

long bunshin_share_stats(void __user *uarg)
{
	struct bunshin_share_stats req;
	struct share_state *st;
	s32 *pids;
	long err;

	if (!capable(CAP_SYS_ADMIN) && !capable(CAP_CHECKPOINT_RESTORE))
		return -EPERM;
	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	err = share_check(&req);
	if (err)
		return err;

	pids = vmemdup_user(u64_to_user_ptr(req.pids_ptr),
			    req.npids * sizeof(*pids));
	if (IS_ERR(pids))
		return PTR_ERR(pids);
	st = share_alloc(req.npids, req.npids);
	if (!st) {
		kvfree(pids);
		return -ENOMEM;
	}
	err = share_run(st, pids, NULL, req.npids);
	if (err)
		goto out;
	req.shared_pages = st->shared;
	req.total_pages = st->total;
	req.nmms = st->nmembers;
	err = share_copy_out(st, pids, req.npids, req.stats_ptr);
	if (!err && copy_to_user(uarg, &req, sizeof(req)))
		err = -EFAULT;
out:
	share_free(st);
	kvfree(pids);
	return err;
}

static int group_check(const struct bunshin_group_stats *req)
{
	size_t i;

	if (req->flags || req->pad ||
	    req->stats_size != sizeof(struct bunshin_group_usage))
		return -EINVAL;
	for (i = 0; i < ARRAY_SIZE(req->reserved); i++)
		if (req->reserved[i])
			return -EINVAL;
	if (!req->npids || !req->ngroups || req->ngroups > req->npids)
		return -EINVAL;
	if (req->npids > BUNSHIN_SHARE_STATS_MAX_PIDS)
		return -E2BIG;
	return 0;
}

static int group_copy_out(struct share_state *st, u32 ngroups, u64 stats_ptr)
{
	struct bunshin_group_usage *out;
	u32 i;
	int err = 0;

	out = kvcalloc(ngroups, sizeof(*out), GFP_KERNEL_ACCOUNT);
	if (!out)
		return -ENOMEM;
	for (i = 0; i < st->nmembers; i++) {
		out[st->members[i].tag].mapped_pages += st->members[i].mapped;
		out[st->members[i].tag].nmms++;
	}
	for (i = 0; i < ngroups; i++) {
		out[i].distinct_pages = st->tags[i].distinct;
		out[i].shared_pages = st->tags[i].distinct - st->tags[i].unique;
	}
	if (copy_to_user(u64_to_user_ptr(stats_ptr), out, ngroups * sizeof(*out)))
		err = -EFAULT;
	kvfree(out);
	return err;
}

long bunshin_group_stats(void __user *uarg)
{
	struct bunshin_group_stats req;
	struct share_state *st;
	u32 *groups = NULL;
	s32 *pids;
	long err;

	if (!capable(CAP_SYS_ADMIN) && !capable(CAP_CHECKPOINT_RESTORE))
		return -EPERM;
	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	err = group_check(&req);
	if (err)
		return err;

	pids = vmemdup_user(u64_to_user_ptr(req.pids_ptr),
			    req.npids * sizeof(*pids));
	if (IS_ERR(pids))
		return PTR_ERR(pids);
	groups = vmemdup_user(u64_to_user_ptr(req.groups_ptr),
			      req.npids * sizeof(*groups));
	if (IS_ERR(groups)) {
		kvfree(pids);
		return PTR_ERR(groups);
	}
	st = share_alloc(req.npids, req.ngroups);
	err = -ENOMEM;
	if (!st)
		goto free_arrays;
	err = share_run(st, pids, groups, req.npids);
	if (err)
		goto out;
	req.shared_pages = st->shared;
	req.total_pages = st->total;
	req.nmms = st->nmembers;
	err = group_copy_out(st, req.ngroups, req.stats_ptr);
	if (!err && copy_to_user(uarg, &req, sizeof(req)))
		err = -EFAULT;
out:
	share_free(st);
free_arrays:
	kvfree(groups);
	kvfree(pids);
	return err;
}
